"""The calibration's report: the headline sentence, calibration.md's table and the figure (calibration.html/png)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from rolemrc.intervene.budget import Budget, coverage_text
from rolemrc.intervene.recommendation import RECOMMENDATION
from rolemrc.intervene.spec import PAPER_FACTOR
from rolemrc.organism.calibration_config import YANG_RANGE
from rolemrc.organism.config import NULL
from rolemrc.organism.scoring import finds_change, measure_of

# per measure, in words: what it is and what "undone" means, what a flag and a break are, what the paper factor moves
MEASURE_TEXT = {
    "judge": {"what": "Measure: the rules judge's verdicts on each cell's generated replies; undone: the share of the "
                      "DPO step's pass-rate change a cell takes back, (cell - DPO) / (SFT - DPO).",
              "flagged": "a dimension's cases and pass rate brought closer to the SFT model's than by the baseline and "
                         "the controls",
              "broken": "out of the SFT model's 95% CI", "paper": "the selected dimension's pass rate",
              "null_panel": "change in pass rate"},
    "kl": {"what": "Measure: teacher-forced KL to the SFT model on its own greedy replies; undone: the share of the DPO "
                   "model's KL to the SFT model a cell undoes, 1 - KL(cell||SFT) / KL(DPO||SFT).",
           "flagged": "a dimension's KL to the SFT model undone beyond the baseline and the controls",
           "broken": "another dimension moved away from the SFT model, or the held-out references' perplexity raised, "
                     "beyond the controls",
           "paper": "a dimension's restoration against the baseline (Holm p < 0.05)",
           "null_panel": "share of its KL undone"}}


def headline(rows: list[dict[str, Any]]) -> str:
    """Per planted organism, which selector finds its change and at what budget; the null's false-positive rate and
    the cells that broke it; whether the paper's factor 1 - 1e-6 changes anything."""
    if not rows:
        return ("No cell ran: every budget was at or above the hook point's width, or no selector could restrain "
                "anything (calibration.json's `skipped` says which).")
    words = MEASURE_TEXT[measure_of(rows[0])]
    null = [r for r in rows if r["organism"] == NULL]
    parts = [_found_text(kind, [r for r in rows if r["organism"] == kind])
             for kind in dict.fromkeys(r["organism"] for r in rows if r["organism"] != NULL)]
    paper = [r for r in rows if r["factor"] == PAPER_FACTOR]
    # under the judge any change of a pass rate counts; a KL moves by a rounding under any restraint, so a tested change
    moved = [r for r in paper if r["changed"] or (measure_of(r) == "judge" and abs(r["restoration"]["cell_minus_dpo"]))]
    fp, broke = sum(bool(r["flagged"]) for r in null), sum(bool(r["broken"]) for r in null)
    second = (f" Null organism: {fp} of {len(null)} cells flagged ({fp / len(null):.0%}, target <= 5%; flagged: "
              f"{words['flagged']}); {broke} broke a dimension ({words['broken']})." if null else "")
    third = (f" The paper's factor 1 - 1e-6 changed {words['paper']} in {len(moved)} of {len(paper)} cells."
             if paper else "")
    return " ".join(parts) + second + third + " " + words["what"]


def _found_text(kind: str, cells: list[dict[str, Any]]) -> str:
    dimension = cells[0]["dimension"]
    found = [r for r in cells if finds_change(r)]
    best: dict[str, dict[str, Any]] = {}
    for r in sorted(found, key=lambda r: r["units"]):
        best.setdefault(r["selector"], r)
    if best:
        parts = [f"{s} from {coverage_text(r['coverage'])} (x{r['factor']:g}: {r['restoration']['share']:.0%} undone, "
                 f"95% CI {r['restoration']['lo']:.0%} to {r['restoration']['hi']:.0%})" for s, r in best.items()]
        missed = sorted({r["selector"] for r in cells} - set(best))
        return (f"The {kind} change ({dimension}) is found by " + "; ".join(parts)
                + (f"; not by {', '.join(missed)}." if missed else "."))
    text = (f"No selector finds the {kind} change ({dimension}): none of {len(cells)} cells has {dimension} flagged "
            f"({MEASURE_TEXT[measure_of(cells[0])]['flagged']}, Holm p < 0.05) with restoration's CI above 0 and no "
            "other dimension broken")
    scored = [r for r in cells if r["restoration"]["lo"] == r["restoration"]["lo"]]
    if scored:
        r = max(scored, key=lambda r: r["restoration"]["lo"])
        text += (f"; closest: {r['selector']} at {coverage_text(r['coverage'])} x{r['factor']:g}, "
                 f"{r['restoration']['share']:.0%} undone (95% CI {r['restoration']['lo']:.0%} to "
                 f"{r['restoration']['hi']:.0%})" + (f", breaking {', '.join(r['broken'])}" if r["broken"] else ""))
    return text + "."


def organism_label(row: dict[str, Any]) -> str:
    """A row's organism, with its seed in a calibration over several."""
    return row["organism"] + (f"@{row['seed']}" if "seed" in row else "")


def units_per_layer(row: dict[str, Any]) -> float:
    """A cell's place on the recovery curve: its per-layer budget (a selector may take fewer units from a layer where
    fewer moved), else the median of its units per layer."""
    return row["budget"].get("per_layer", row["coverage"]["per_layer"]["median"])


def recovery(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The recovery curve: per planted organism, selector and factor, the share of the change undone (95% CI) at each
    budget, by units per layer (`units_per_layer`), beside its random-unit controls' shares."""
    out = [{"organism": r["organism"], "dimension": r["dimension"], "selector": r["selector"], "factor": r["factor"],
            "per_layer": units_per_layer(r), "units": r["units"],
            **{k: r["restoration"][k] for k in ("share", "lo", "hi")}, "controls": r["controls_restoration"],
            "found": finds_change(r), "broken": r["broken"]} for r in rows if r["organism"] != NULL]
    return sorted(out, key=lambda c: (c["organism"], c["selector"], c["factor"], c["units"]))


# what a user should do next, per status
NEXT = {
    "found": "Next: select the recipe's units from your own diff with `rolemrc intervene select --calibration` on this "
             "folder, then check them on your data with `rolemrc sweep run` (random-unit controls) before you serve "
             "the restraint.",
    "unstable": "Next: do not take a recipe from this calibration. Read why above; run more seeds (`--seeds 5`) or the "
                "full grid (without `--quick`) and check it against this one (`--against`); until a recipe is found, "
                "name `--method` and `--factor` yourself and judge them only by `rolemrc sweep run` against "
                "random-unit controls.",
    "none": "Next: no selector undid a known change on this base, so the probe-and-restrain method has no evidence "
            "here. Try other budgets (`--per-layer`), selectors or measures, or more DPO steps for the organisms; do "
            "not read a restraint's effect on your model as the units that changed."}


def recommendation_text(rec: dict[str, Any]) -> str:
    """One line on what `intervene select --calibration` takes from this calibration, or why it refuses; the settings
    it holds over and those it fails under; and what to do next."""
    over = "; ".join(_settings(r) for r in rec.get("holds_over", []))
    if rec["status"] != "found":
        text = f"No recommendation ({rec['status']}): {rec['why']}. `intervene select --calibration` refuses it."
        return text + (f" Settings: {over}." if rec["status"] == "unstable" else "") + " " + NEXT[rec["status"]]
    return (f"Recommended: {rec['selector']} x{rec['factor']:g} at {Budget.of(rec['budget']).label} "
            f"({rec['why']}); `intervene select --calibration` takes it. It holds over: {over}. {NEXT['found']}")


SETTING_NAMES = ("measure", "probe_cases", "attribution_pairs", "heldout_cases", "dpo_steps", "organism_seed", "control_seed")


def _settings(rests_on: dict[str, Any]) -> str:
    said = [f"{k.replace('_', ' ')} {rests_on[k]}" for k in SETTING_NAMES if rests_on.get(k) is not None]
    return ", ".join(said) or "nothing recorded"


def frontier_markdown(frontiers: dict[str, Any], over_seeds: list[dict[str, Any]] | None = None,
                      leads: list[dict[str, Any]] | None = None) -> list[str]:
    """Each planted organism's restraint frontier (`--frontier`): its headline and figure; over several seeds, each
    point's restoration and excess over its controls with a t-interval over seeds, which family led in how many, and
    each pair of families' lead at matched size with a t-interval over seeds (`seeds.frontier_leads_over_seeds`)."""
    if not frontiers:
        return []
    lines = ["", "## Restraint frontiers", "", "Every restraint kind on each organism's pair, against controls of its own "
             "kind, sized by its KL from the DPO model on neutral texts (`rolemrc sweep frontier`).", ""]
    for kind, f in frontiers.items():
        html = (f.get("figures") or {}).get("frontier", {}).get("html", "")
        lines += [f"- **{kind}**: {f['headline']}" + (f" ([figure]({html}))" if html else "")]
    def ci(x: dict) -> str:
        return f"{x['mean']:.3f}" + ("" if x["lo"] is None else f" [{x['lo']:.3f}, {x['hi']:.3f}]")

    if over_seeds:
        lines += ["", f"Over {over_seeds[0]['seeds']} seeds (mean, 95% t-interval over seeds):", "",
                  "| organism | family | setting | restoration | size (KL from DPO) | excess over controls |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['organism']} | {r['family']} | {', '.join(f'{k} {v:g}' for k, v in r['setting'].items())} | "
                  f"{ci(r['restoration'])} | {ci(r['size'])} | {ci(r['excess']) if r['excess']['n'] else '–'} |"
                  for r in over_seeds]
        led = {r["organism"]: r["leads"] for r in over_seeds}
        lines += ["", *(f"- {kind}: at matched size, " + (", ".join(f"{f} led in {n} seed(s)" for f, n in count.items())
                        or "no two families overlapped in size") for kind, count in led.items())]
    if leads:
        lines += ["", "Each pair of families at matched size (a size both reach in every seed; each seed's "
                  "restoration interpolated in log size): the mean lead over seeds, 95% t-interval over seeds:", "",
                  "| organism | size (KL from DPO) | leader | over | lead | per seed |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['organism']} | {r['size']:.3g} | {r['leader']} | {r['other']} | {ci(r['lead'])} | "
                  f"{', '.join(f'{v:+.3f}' for v in r['leads'])} |" for r in leads]
    return lines


def calibration_markdown(result: dict[str, Any]) -> str:
    lines = [f"**{result['headline']}**", "", recommendation_text(result[RECOMMENDATION]), "",
             *null_bound_text(result.get("null_bound")), *missed_text(result.get("missed_targets", [])),
             "## Recovery curve", "", "The share of each planted change undone (by the calibration's measure) against "
             "units per layer (Yang et al., "
             f"arXiv 2411.06424: ablating the units DPO changed explains {YANG_RANGE[0]:.1%} to {YANG_RANGE[1]:.0%} of "
             "its effect).", "",
             "| organism | selector | factor | units per layer | units | undone (95% CI) | random-unit controls | found |",
             "|---|---|---|---|---|---|---|---|"]
    for c in result["recovery"]:
        ctrl = ", ".join(f"{x:.0%}" for x in c["controls"]) or "-"
        found = "yes" if c["found"] else (f"no (broke {', '.join(c['broken'])})" if c["broken"] else "no")
        lines.append(f"| {organism_label(c)} ({c['dimension']}) | {c['selector']} | {c['factor']:g} | {c['per_layer']:g} | "
                     f"{c['units']:,} | {c['share']:.0%} ({c['lo']:.0%} to {c['hi']:.0%}) | {ctrl} | {found} |")
    lines += over_seeds_markdown(result.get("over_seeds", []))
    lines += frontier_markdown(result.get("frontiers", {}), result.get("frontier_over_seeds", []),
                               result.get("frontier_leads_over_seeds", []))
    lines += detection_markdown(result.get("detection", {}))
    lines += ["", "## Stability of the selections", "", "The Jaccard overlap of the units each selector takes from "
              "Poisson bootstrap resamples of the probe cases (of the attribution pairs for attribution), beside two "
              "random selections of the same size.", "",
              "| organism | dimension | selector | budget | units | Jaccard mean (min) between resamples | "
              "resample vs full sample | chance |", "|---|---|---|---|---|---|---|---|"]
    for r in result["stability"]:
        lines.append(f"| {organism_label(r)} | {r['dimension']} | {r['method']} | {r['budget']} | {r['units']:,} | "
                     f"{_j(r['jaccard_mean'])} ({_j(r['jaccard_min'])}) over {r['resamples']} | {_j(r['jaccard_full'])} "
                     f"| {r['chance']:.2f} |")
    lines += ["", "## Every cell", "",
              "| organism | selected for | selector | units (share of all; per layer) | factor | undone (95% CI) | "
              "controls | p vs baseline | p vs controls | other dimensions (diff, Holm p) | closer to SFT | broken |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["cells"]:
        s = r["restoration"]
        ctrl = (", ".join(f"{c:.0%}" for c in r["controls_restoration"]) or "-") + _placement(r.get("placement"))
        others = "; ".join(f"{k} {v['diff']:+.2f} ({v['p_holm']:.2g})" for k, v in r["others"].items())
        lines.append(f"| {organism_label(r)} | {r['dimension']} | {r['selector']} | {coverage_text(r['coverage'])} | "
                     f"{r['factor']:g} | {s['share']:.0%} ({s['lo']:.0%} to {s['hi']:.0%}) | {ctrl} | "
                     f"{_p(r['p_vs_baseline'])} | {_p(r['p_vs_controls'])} | {others} | {', '.join(r['flagged']) or '-'} "
                     f"| {', '.join(r['broken']) or '-'} |")
    lines += time_markdown(result.get("time", []))
    lines += ["", "Units the diffs flag by themselves (BH q < 0.05): "
              + "; ".join(f"{k} {d} {t}: frequency {v['frequency']}, effect {v['effect']}"
                          for k, dims in result["diff_flags"].items() for d, ts in dims.items() for t, v in ts.items())]
    return "\n".join(lines) + "\n"


def time_markdown(time: list[dict[str, Any]]) -> list[str]:
    """Where the time went: seconds per stage (summed over organisms and seeds, as each last ran), slowest first."""
    if not time:
        return []
    total = sum(t["seconds"] for t in time)
    return ["", "## Where the time went", "", f"Every stage as it last ran (a rerun reuses them), {total / 60:.1f} min in "
            "all: organism builds (data, training, evals) and the calibration's probes, attribution and sweeps.", "",
            "| stage | runs | seconds | share |", "|---|---|---|---|",
            *(f"| {t['stage']} | {t['runs']} | {t['seconds']:,.0f} | {t['share']:.0%} |" for t in time)]


def missed_text(missed: list[dict[str, Any]]) -> list[str]:
    """The organisms that missed their target: never used, each with its seed and what moved."""
    if not missed:
        return []
    return ["Organisms that missed their target, left out (each retried with the next seed, up to --retries):", "",
            *(f"- seed {m['seed']} ({m['folder']}): {m['headline']}" for m in missed), ""]


def null_bound_text(bound: dict[str, Any] | None) -> list[str]:
    """What the null's cells bound the false-positive rate at, and what a 5% bound needs."""
    if not bound or not bound["cells"]:
        return ["No null organism ran: nothing bounds the false-positive rate.", ""]
    enough = ("at or below 5%" if bound["upper_bound"] <= 0.05 else
              f"above the 5% target, which needs 0 flagged of at least {bound['cells_for_5pct']} null cells")
    return [f"Null organism: {bound['flagged']} of {bound['cells']} cells moved a dimension beyond their controls "
            "(flagged or broken), so the false-positive rate is at "
            f"most {bound['upper_bound']:.0%} (exact one-sided 95% bound), {enough}.", ""]


def over_seeds_markdown(over: list[dict[str, Any]]) -> list[str]:
    """The verdicts read at seed level: per recipe and planted organism, each seed's share undone and their t-CI."""
    if not over:
        return []
    lines = ["", "## Over seeds", "", "Each recipe's share of each planted change undone, per seed, and their mean with a "
             "Student-t 95% interval over the seeds (the variance of training, probe cases and controls).", "",
             "| organism | selector | budget | factor | per seed | mean (95% CI over seeds) | lead over the controls' "
             "median (95% CI over seeds) | found in |", "|---|---|---|---|---|---|---|---|"]
    for o in over:
        selector, budget, factor = o["recipe"]
        ci = f" ({o['lo']:.0%} to {o['hi']:.0%})" if o["lo"] is not None else ""
        gap = o.get("gap") or {"mean": math.nan, "lo": None}
        lead = f"{gap['mean']:+.0%}" + (f" ({gap['lo']:+.0%} to {gap['hi']:+.0%})" if gap["lo"] is not None else "")
        lines.append(f"| {o['organism']} | {selector} | {Budget.of(budget).label} | {factor:g} | "
                     f"{', '.join(f'{x:.0%}' for x in o['shares'])} | {o['mean']:.0%}{ci} | {lead} | {o['found_in']} |")
    return lines


def detection_markdown(detection: dict[str, dict[str, Any]]) -> list[str]:
    """Where the change lives: per units organism, how well each selector's ranking finds its known units S."""
    lines = []
    for kind, d in detection.items():
        lines += ["", f"## Where the {kind} change lives: detection of its known units", "",
                  "Each selector's ranking of every unit against the units the DPO update could reach (S), over "
                  f"{len(d['per_seed'])} seed(s): mean (95% t-interval over seeds).", "",
                  "| selector | AUROC | precision at \\|S\\| | recall at 4\\|S\\| | chance (AUROC, precision, recall) "
                  "| verdict |", "|---|---|---|---|---|---|"]
        for name, s in d["summary"].items():
            cells = [f"{s[m]['mean']:.2f}" + (f" ({s[m]['lo']:.2f} to {s[m]['hi']:.2f})" if s[m]["lo"] is not None
                                             else "") for m in ("auroc", "precision_at_s", "recall_at_4s")]
            chance = ", ".join(f"{v:.3g}" for v in s["chance"].values())
            lines.append(f"| {name} | {' | '.join(cells)} | {chance} | {s['verdict']} |")
        unmet = [k for k, row in enumerate(d["per_seed"]) if not row["meets_target"]]
        if unmet:
            lines += ["", f"The units organism missed its behavioural target in {len(unmet)} of {len(d['per_seed'])} "
                      "seed(s). Its S still carries its whole update (the carrier check), so detection is read on it; "
                      "no restraint cell ran on it. An organism whose change is gross (replies broken) may be easier to "
                      "localize than a subtle one.", "",
                      *(f"- seed {d['per_seed'][k]['seed']}: {d['per_seed'][k]['organism']}" for k in unmet)]
    return lines


def detection_figure(detection: dict[str, dict[str, Any]], out: Path) -> dict[str, str]:
    """Per units organism kind (a row each) and metric (a column each: AUROC, precision at |S|, recall at 4|S|),
    every selector's value on each seed (dots; hollow where the organism missed its behavioural target) and their mean
    with its 95% t-interval over seeds, against the chance level (dotted). Written as out/detection.html/png."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from rolemrc.core.figures import write_figure
    from rolemrc.organism.detection import METRICS

    names = {"auroc": "AUROC over all units", "precision_at_s": "precision at |S|", "recall_at_4s": "recall at 4|S|"}
    kinds = list(detection)
    fig = make_subplots(rows=len(kinds), cols=len(METRICS), horizontal_spacing=0.07,
                        subplot_titles=[f"{kind}: {names[m]}" for kind in kinds for m in METRICS])
    for row, kind in enumerate(kinds, 1):
        d = detection[kind]
        selectors = list(d["summary"])
        at, spread = list(range(len(selectors))), 0.1   # each seed's dot beside its selector's mean, not under it
        for col, metric in enumerate(METRICS, 1):
            first = row == col == 1
            for k, seed in enumerate(d["per_seed"]):
                shift = spread * (k - (len(d["per_seed"]) - 1) / 2) + 0.2
                fig.add_trace(go.Scatter(
                    x=[x + shift for x in at], y=[seed["selectors"][s][metric] for s in selectors], mode="markers",
                    marker={"size": 9, "color": "#636EFA", "opacity": 0.6,
                            "symbol": "circle" if seed["meets_target"] else "circle-open"},
                    name="a seed (hollow: organism missed its target)", legendgroup="seed",
                    showlegend=first and k == 0, hovertext=[f"seed {seed['seed']}: {seed['organism']}"] * len(selectors)),
                    row, col)
            summary = [d["summary"][s][metric] for s in selectors]
            fig.add_trace(go.Scatter(
                x=at, y=[m["mean"] for m in summary], mode="markers", name="mean, 95% t-interval over seeds",
                marker={"size": 14, "symbol": "line-ew-open", "color": "black", "line": {"width": 3}},
                error_y={"type": "data", "symmetric": False,
                         "array": [(m["hi"] - m["mean"]) if m["hi"] is not None else 0 for m in summary],
                         "arrayminus": [(m["mean"] - m["lo"]) if m["lo"] is not None else 0 for m in summary]},
                legendgroup="mean", showlegend=first), row, col)
            chance = d["summary"][selectors[0]]["chance"][metric]
            fig.add_hline(y=chance, line={"dash": "dot", "color": "grey"}, annotation_text=f"chance {chance:.3g}",
                          annotation_position="top right", row=row, col=col)
            fig.update_yaxes(range=[-0.03, 1.03], row=row, col=col)
            fig.update_xaxes(tickvals=at, ticktext=selectors, range=[-0.5, len(at) - 0.2], tickangle=0,
                             tickfont={"size": 10}, row=row, col=col)
    seeds = max(len(d["per_seed"]) for d in detection.values())
    fig.update_layout(title=f"Where the change lives: each selector's ranking against the known units S "
                            f"({seeds} seed(s))", height=420 * len(kinds) + 80, width=1200,
                      legend={"orientation": "h", "y": -0.12})
    return write_figure(fig, out, "detection", width=None, height=None)


def _placement(p: dict[str, Any] | None) -> str:
    """' (percentile P among K; gap to their median G, 95% CI)', or nothing without a placement."""
    if not p or not p.get("k"):
        return ""
    return (f" (percentile {p['percentile']:.0f} among {p['k']}; gap to their median {p['gap']:+.0%}, 95% CI "
            f"{p['lo']:+.0%} to {p['hi']:+.0%})")


def _j(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _p(p: float | None) -> str:
    return "-" if p is None else f"{p:.2g}"


def collateral(row: dict[str, Any]) -> tuple[float, float | None]:
    """A cell's cost on the dimensions it did not select for: the mean over them of its change against the baseline
    (under KL their share undone, below 0 moved away from the SFT model), and its controls' mean of the same (None
    where the rows do not carry the cell's difference to its controls: judge rows)."""
    others = {d: o for d, o in row["others"].items() if d != row["dimension"] and "neutral" not in d}
    if not others:
        return math.nan, None
    cell = float(np.mean([o["diff"] for o in others.values()]))
    if not all("vs_controls" in o for o in others.values()):
        return cell, None
    return cell, float(np.mean([o["diff"] - o["vs_controls"] for o in others.values()]))


def _band(values: list[float]) -> tuple[float, float, float]:
    """(mean, lo, hi) of per-seed values: the Student-t 95% interval over them, the value itself for one."""
    from rolemrc.core.stats import t_interval

    t = t_interval(values)
    return t["mean"], t["lo"] if t["lo"] is not None else t["mean"], t["hi"] if t["hi"] is not None else t["mean"]


def calibration_figure(rows: list[dict[str, Any]], out: Path) -> dict[str, str]:
    """Restoration and collateral over budgets: per planted organism (a column each, the null last) the share of its
    change undone (top) and the mean change of every other dimension (bottom, below 0 moved away from the SFT model)
    against units per layer, a line per selector and factor (a colour per selector; factor 0 solid, others dashed)
    at the mean over seeds with its 95% t-interval over seeds as a band of the line's colour (each seed's cell a faint
    dot; with one seed the cases bootstrap CI as error bars), found cells as stars and cells that broke another
    dimension as crosses; the random-unit controls as a grey band (lowest to highest of every seed's controls at each
    size) and Yang et al.'s 2.5-24% shaded. The null has no planted change: under the judge its top panel is the change
    in each selected dimension's pass rate, under KL the share of its DPO model's KL to the SFT model undone."""
    import plotly.graph_objects as go
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    from rolemrc.core.figures import write_figure

    panels = sorted({(r["organism"], r["dimension"]) for r in rows}, key=lambda p: (p[0] == NULL, p))
    color = {s: qualitative.Plotly[k % len(qualitative.Plotly)] for k, s in enumerate(sorted({r["selector"] for r in rows}))}
    measure = measure_of(rows[0])
    seeds = sorted({r.get("seed", 0) for r in rows})
    titles = [f"null, selected for<br>{d}:<br>{MEASURE_TEXT[measure]['null_panel']}" if k == NULL else
              f"{k}<br>({d}):<br>share undone" for k, d in panels]
    fig = make_subplots(rows=2, cols=len(panels), subplot_titles=titles + [""] * len(panels),
                        horizontal_spacing=0.06, vertical_spacing=0.1, shared_xaxes=True)
    per_layer = units_per_layer
    for col, (kind, dimension) in enumerate(panels, 1):
        mine = [r for r in rows if (r["organism"], r["dimension"]) == (kind, dimension)]
        share = kind != NULL or measure == "kl"
        value = (lambda r: r["restoration"]["share"]) if share else (lambda r: r["restoration"]["cell_minus_dpo"])
        controls = "controls_restoration" if share else "controls_change"
        xs = sorted({per_layer(r) for r in mine})
        band = [[c for r in mine if per_layer(r) == x for c in r[controls] if c == c] or [0.0] for x in xs]
        spent = [[c for r in mine if per_layer(r) == x for c in [collateral(r)[1]] if c is not None] for x in xs]
        for row, low, high, first in ((1, [min(c) for c in band], [max(c) for c in band], col == 1),
                                      (2, [min(c) if c else math.nan for c in spent],
                                       [max(c) if c else math.nan for c in spent], False)):
            fig.add_trace(go.Scatter(x=xs + xs[::-1], y=high + low[::-1], fill="toself",
                                     fillcolor="rgba(120,120,120,0.3)", line={"width": 1, "color": "grey"},
                                     name="random-unit controls", legendgroup="controls", showlegend=first,
                                     hoverinfo="skip"), row, col)
        if kind != NULL:
            fig.add_hrect(y0=YANG_RANGE[0], y1=YANG_RANGE[1], fillcolor="rgba(255,165,0,0.18)", line_width=0,
                          annotation_text="Yang et al.", annotation_position="top left", row=1, col=col)
        for selector in sorted({r["selector"] for r in mine}):
            for factor in sorted({r["factor"] for r in mine}):
                line = [r for r in mine if (r["selector"], r["factor"]) == (selector, factor)]
                group, shown = f"{selector}{factor}", col == 1
                dash = "solid" if factor == 0 else "dash"
                for row, measure_of_row in ((1, value), (2, lambda r: collateral(r)[0])):
                    at = sorted({per_layer(r) for r in line})
                    stats = [_band([measure_of_row(r) for r in line if per_layer(r) == x]) for x in at]
                    if len(seeds) > 1:
                        fig.add_trace(go.Scatter(x=at + at[::-1], y=[s[2] for s in stats] + [s[1] for s in stats][::-1],
                                                 fill="toself", fillcolor=_alpha(color[selector], 0.18), line={"width": 0},
                                                 legendgroup=group, showlegend=False, hoverinfo="skip"), row, col)
                        fig.add_trace(go.Scatter(x=[per_layer(r) for r in line], y=[measure_of_row(r) for r in line],
                                                 mode="markers", marker={"color": color[selector], "size": 5,
                                                                         "opacity": 0.45},
                                                 legendgroup=group, showlegend=False,
                                                 hovertext=[f"seed {r.get('seed')}" for r in line]), row, col)
                    if row == 1:
                        last = {per_layer(r): r for r in line}
                        symbol = ["star" if any(finds_change(r) or (kind == NULL and r["flagged"]) for r in line
                                                if per_layer(r) == x) else
                                  "x" if any(r["broken"] for r in line if per_layer(r) == x) else "circle" for x in at]
                        error = ({"type": "data", "symmetric": False,
                                  "array": [last[x]["restoration"]["hi"] - s[0] for x, s in zip(at, stats)],
                                  "arrayminus": [s[0] - last[x]["restoration"]["lo"] for x, s in zip(at, stats)]}
                                 if share and len(seeds) == 1 else None)
                    else:
                        symbol, error = ["circle"] * len(at), None
                    fig.add_trace(go.Scatter(
                        x=at, y=[s[0] for s in stats], mode="lines+markers", name=f"{selector} x{factor:g}",
                        legendgroup=group, showlegend=shown and row == 1,
                        marker={"color": color[selector], "symbol": symbol,
                                "size": [14 if m != "circle" else 7 for m in symbol]},
                        line={"dash": dash, "color": color[selector]}, error_y=error), row, col)
        fig.update_xaxes(type="log", row=1, col=col)
        fig.update_xaxes(type="log", title_text="units per layer", row=2, col=col)
    fig.update_yaxes(title_text="share undone", row=1, col=1)
    fig.update_yaxes(title_text="collateral: other dimensions'<br>mean change (below 0: away from SFT)", row=2, col=1)
    over = f"mean over {len(seeds)} seeds, band: 95% t-interval over seeds; " if len(seeds) > 1 else ""
    fig.update_layout(template="plotly_white", margin={"t": 230}, width=300 * len(panels) + 300, height=880,
                      title_y=0.985, title_yanchor="top",
                      title=f"Restoration and collateral: does restraining a selector's units undo a known change? (by "
                            f"{'KL to the SFT model' if measure == 'kl' else 'the judge'})<br><sup>{over}stars: "
                            "found (undone beyond the baseline and the controls, nothing else broken;<br>on the null: "
                            "flagged, a false positive); crosses: broke another dimension; grey: random-unit "
                            "controls; orange: Yang et al.'s 2.5-24%</sup>")
    return write_figure(fig, out, "calibration", plotlyjs=True)


def _alpha(color: str, alpha: float) -> str:
    """A plotly '#rrggbb' colour as rgba with `alpha`."""
    r, g, b = (int(color[k:k + 2], 16) for k in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"
