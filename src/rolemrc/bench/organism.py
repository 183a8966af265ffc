"""`rolemrc bench organism`: does the method find a change whose answer is known?

For each organism (planted, null): probe SFT and DPO together on cases never trained on (last prompt token and every
prompt token), diff them, attribute the DPO margin over the organism's pairs, then per selector x unit budget x
factor restrain the DPO model through the sweep (random-unit controls, Holm) on the held-out cases, and score each
cell against the known answer:

- restoration: the share of the planted change undone, (cell - DPO) / (SFT - DPO) on the planted dimension, with a
  paired bootstrap 95% CI over the held-out cases (numerator and denominator resampled together); the same for the
  cell's random-unit controls (the control band);
- the cost on every other dimension (the cell's change against the baseline, Holm p);
- flagged: the dimensions whose cases and pass rate the cell brings closer to the SFT model's than the baseline and
  its controls do (paired per-case distance tests, Holm over the organism's cells x dimensions). On the planted
  organism that is the claim "these units hold the change"; on the null, where nothing systematic changed, the share
  of cells flagged is the pipeline's false-positive rate. Beside it, the cells that change some dimension against the
  baseline (restraining units that matter breaks behaviour whether or not they hold a change), and how many units each
  diff flags by itself (BH q < 0.05).

The paper's factor 1 - 1e-6 runs as a sweep of its own at the largest budget only (`paper_factor_budgets`).
Every stage is cached under --out (organisms, probes, diffs, attribution, one sweep per organism and selector, the
sweeps of an organism sharing one store of generated cells, so their common baseline is generated once), so a rerun
of the grid alone only generates the cells that are new.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rolemrc.core.io import read_jsonl, write_json, write_jsonl
from rolemrc.core.stages import StageCache
from rolemrc.core.taxonomy import dimensions_for_task

PAPER_FACTOR = 1 - 1e-6
SELECTOR_INPUTS = {"frequency": "last", "frequency-all": "all", "standardized": "all", "attribution": "attribution"}
ALPHA = 0.05
BOOTSTRAP = 2000


@dataclass
class Organism:
    """What calibration needs of an organism: its two models, the pairs DPO trained on, the held-out cases with the
    SFT model's eval run on them, the probe cases (never trained on) and the dimension it changes."""

    kind: str
    sft: str
    dpo: str
    pairs: str
    heldout: str
    sft_eval: str
    probe: str
    dimension: str

    @classmethod
    def from_report(cls, report: dict[str, Any], probe: str | Path) -> Organism:
        return cls(report["kind"], report["sft"], report["dpo"], report["pairs"], report["heldout"],
                   report["sft_eval"], str(probe), report["planted_dimension"])


@dataclass
class CalibrationConfig:
    """The grid and its costs. Budgets are units per layer (top_k = budget x layers, ranked over all layers)."""

    out: str
    selectors: list[str] = field(default_factory=lambda: list(SELECTOR_INPUTS))
    # 64 per layer is cut to keep the full bench under 2 h on 2 cores: with it, the run alone took 2 h 4 min, and at
    # 1,920 units no selector undid anything on either organism
    budgets: list[int] = field(default_factory=lambda: [16, 256])
    factors: list[float] = field(default_factory=lambda: [0.0, 0.5])
    # the paper's near-identity factor 1 - 1e-6 as its own sweep, at these budgets only: its effect can only grow with
    # the units it scales, so the largest budget is where it would show
    paper_factor_budgets: list[int] = field(default_factory=lambda: [256])
    controls: int = 1
    attribution_pairs: int = 16       # organism pairs (of the planted dimension first) attribution runs over
    max_new_tokens: int = 32          # as the organisms' held-out eval, so the SFT run is comparable
    batch_size: int = 32              # rows per generation batch (the sweep's cells share batches)
    hook: str = "mlp.act"
    seed: int = 0

    def __post_init__(self) -> None:
        from rolemrc.probe.hooks import check_point

        check_point(self.hook)
        unknown = sorted(set(self.selectors) - set(SELECTOR_INPUTS))
        if unknown:
            from rolemrc.core.errors import InputError

            raise InputError(f"unknown selector(s) {unknown}; calibration knows {', '.join(SELECTOR_INPUTS)}")


# `--quick`: the paper's selector and attribution (the one that ranks units by their effect on the preference), the
# largest budget only (the one a change spread over many units can show at), both ends of the factors, half the
# attribution pairs and probe cases.
QUICK = {"selectors": ["frequency", "attribution"], "budgets": [256], "factors": [0.0], "paper_factor_budgets": [256],
         "attribution_pairs": 8}
QUICK_PROBE_CASES = 24
# the organisms of the full bench: every planted case and 4 per other dimension (all 144 of datagen's small test set
# would triple the cost of every cell)
ORGANISMS = {"eval_others": 4}


def probe_cases(pairs_file: Path, exclude: set[str], n: int, seed: int) -> list[dict[str, Any]]:
    """`n` test-style cases from datagen's pair prompts that no organism trained on, spread over the tasks."""
    from rolemrc.organism.pairs import sample_prompts

    rows = [r for r in read_jsonl(pairs_file) if r["id"] not in exclude]
    return [{"id": r["id"], "question": r["prompt"], "reference": r["chosen"], "task": r.get("task")}
            for r in sample_prompts(rows, n, seed)]


def attribution_pairs(pairs: list[dict[str, Any]], dimension: str, n: int) -> list[dict[str, Any]]:
    """Up to `n` pairs, those whose task counts in `dimension` first (the attribution selector scores that one)."""
    inside = [p for p in pairs if dimension in dimensions_for_task(p.get("task"))]
    return (inside + [p for p in pairs if p not in inside])[:n]


def probe_stages(cache: StageCache, organism: Organism, config: CalibrationConfig, root: Path) -> dict[str, str]:
    """selector input kind -> path: a paired diff per token policy, and the attribution file."""
    from rolemrc.probe import attribute, collect_paired, diff, write_diff

    inputs = {}
    for tokens in ("last", "all"):
        paired = root / f"probe-{tokens}.safetensors"
        cache.run(f"{organism.kind} probe {tokens}", {"models": [Path(organism.sft), Path(organism.dpo)],
                                                      "data": Path(organism.probe), "hook": config.hook},
                  lambda tokens=tokens, paired=paired: {"out": str(collect_paired(
                      [organism.sft, organism.dpo], organism.probe, hook=config.hook, tokens=tokens).save(paired))},
                  [paired])
        out = root / f"diff-{tokens}"
        cache.run(f"{organism.kind} diff {tokens}", {"paired": paired},
                  lambda paired=paired, out=out: write_diff(diff(paired), out, figures=False),
                  [out / "diff.safetensors"])
        inputs[tokens] = str(out)
    chosen = root / "attribution-pairs.jsonl"
    scores = root / "attribution.safetensors"

    def attribute_stage() -> dict:
        write_jsonl(chosen, attribution_pairs(read_jsonl(organism.pairs), organism.dimension, config.attribution_pairs))
        attribute(organism.sft, organism.dpo, str(chosen), hook=config.hook).save(scores)
        return {"out": str(scores)}

    cache.run(f"{organism.kind} attribute", {"models": [Path(organism.sft), Path(organism.dpo)],
                                             "pairs": Path(organism.pairs), "n": config.attribution_pairs,
                                             "hook": config.hook}, attribute_stage, [scores])
    inputs["attribution"] = str(scores)
    return inputs


def diff_flags(diff_dir: str, dimension: str, fdr: float = ALPHA) -> dict[str, int | None]:
    """Units the diff flags by itself in `dimension`: BH q < fdr on the frequency test and on the effect test."""
    from rolemrc.probe import load_diff

    result = load_diff(diff_dir)
    count = lambda q: int((q.get(dimension) < fdr).sum()) if dimension in q else None  # noqa: E731
    return {"frequency": count(result.qvalue) if result.tested else None,
            "effect": count(result.effect_q) if result.effect_tested else None}


def layers_of(model: str, hook: str) -> int:
    from rolemrc.probe.attribution import config_shape

    return int(config_shape(model, hook)["layers"])


def sweeps(config: CalibrationConfig) -> dict[str, tuple[list[int], list[float]]]:
    """A selector's sweeps, by folder suffix: budgets x factors, and the paper's factor at its own budgets."""
    grids = {"": (config.budgets, config.factors)}
    if config.paper_factor_budgets:
        grids["-paper"] = (config.paper_factor_budgets, [PAPER_FACTOR])
    return {suffix: grid for suffix, grid in grids.items() if grid[0] and grid[1]}


def sweep_stage(organism: Organism, selector: str, source: str, config: CalibrationConfig, out: Path,
                budgets: list[int], factors: list[float]) -> dict:
    """One sweep (the sweep resumes by itself: finished cells are kept) of `selector` over budgets x factors, its
    cells in the organism's shared store."""
    from rolemrc.sweep import SweepConfig, run_sweep

    layers = layers_of(organism.dpo, config.hook)
    sweep = SweepConfig(model=organism.dpo, diff=source, data=organism.heldout, out=str(out),
                        cells_dir=str(out.parent / "cells"), dimensions=[organism.dimension], factors=list(factors),
                        top_k=[b * layers for b in budgets], method=selector, controls=config.controls,
                        seed=config.seed, max_new_tokens=config.max_new_tokens, batch_size=config.batch_size)
    return run_sweep(sweep, metrics=[])


def per_item(run_dir: Path | str) -> dict[str, dict[str, float]]:
    from rolemrc.eval.runs import EvalRun
    from rolemrc.sweep.stats import item_scores

    return item_scores(EvalRun.load(run_dir))


def restoration(sft: dict[str, float], dpo: dict[str, float], cell: dict[str, float], *, rounds: int = BOOTSTRAP,
                seed: int = 0) -> dict[str, Any]:
    """Share of the change SFT -> DPO that `cell` undoes, (cell - dpo) / (sft - dpo) over the items all three
    scored, with a paired bootstrap 95% CI (items resampled, numerator and denominator together; resamples with no
    change left out). NaN when SFT and DPO do not differ on these items."""
    ids = sorted(set(sft) & set(dpo) & set(cell))
    s, d, c = (np.array([x[i] for i in ids]) for x in (sft, dpo, cell))
    change = s.mean() - d.mean()
    share = float((c.mean() - d.mean()) / change) if change else float("nan")
    idx = np.random.default_rng(seed).integers(0, len(ids), size=(rounds, len(ids)))
    num, den = c[idx].mean(1) - d[idx].mean(1), s[idx].mean(1) - d[idx].mean(1)
    boot = num[den != 0] / den[den != 0]
    lo, hi = (np.percentile(boot, [2.5, 97.5]).tolist() if boot.size and change else [float("nan")] * 2)
    return {"share": share, "lo": lo, "hi": hi, "n": len(ids), "change": float(change),
            "cell_minus_dpo": float(c.mean() - d.mean())}


def toward_sft(sft: dict[str, dict[str, float]], base: dict[str, dict[str, float]], cell: dict[str, dict[str, float]],
               controls: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """dimension -> how far the cell lies from the SFT model against the baseline and the controls (their mean per
    case): paired tests of the per-case distance |cell - SFT| (`vs_baseline`, `vs_controls`; diff < 0 = closer) and
    the distance of the pass rates (`rate_gap`). Both count: a restraint that breaks the behaviour agrees with SFT
    on the cases SFT fails, and one that only moves the rate can do it with other cases than the ones DPO changed."""
    from rolemrc.core.stats import paired_test

    out = {}
    for name in sorted(set(sft) & set(base) & set(cell)):
        ids = sorted(set(sft[name]) & set(base[name]) & set(cell[name]).intersection(*(c.get(name, {}) for c in controls)))
        if not ids:
            continue
        target = np.array([sft[name][i] for i in ids])
        base_x, mine, *ctrl = (np.array([s[name][i] for i in ids]) for s in (base, cell, *controls))
        entry = {"vs_baseline": paired_test(np.abs(base_x - target), np.abs(mine - target)),
                 "rate_gap": {"baseline": abs(base_x.mean() - target.mean()), "cell": abs(mine.mean() - target.mean())}}
        if ctrl:
            ctrl_x = np.mean(ctrl, axis=0)
            entry["vs_controls"] = paired_test(np.abs(ctrl_x - target), np.abs(mine - target))
            entry["rate_gap"]["controls"] = abs(ctrl_x.mean() - target.mean())
        out[name.removeprefix("judge:")] = entry
    return out


def cell_rows(organism: Organism, selector: str, summary: dict, sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per grid cell: restoration with CI, its controls' restoration, p against baseline and controls on the
    planted dimension (Holm over the sweep's grid), the cost on the other dimensions, the dimensions it changes
    against the baseline, and its distance to the SFT model per dimension (`toward_sft`, Holm-corrected later)."""
    plan = json.loads((sweep_dir / "plan.json").read_text())["cells"]
    key = f"judge:{organism.dimension}"
    sft_all = {k: v for k, v in per_item(organism.sft_eval).items() if k.startswith("judge:")}
    sft = sft_all.get(key, {})
    base_id = next(c["id"] for c in plan if c["kind"] == "baseline")
    base_all = per_item(sweep_dir / "scores" / base_id)
    dpo = base_all.get(key, {})
    rows = []
    for cell in summary["cells"]:
        grid = {k: cell[k] for k in ("dimension", "factor", "top_k")}
        controls = [per_item(sweep_dir / "scores" / c["id"]) for c in plan
                    if c["kind"] == "control" and c["grid"] == grid]
        mine_all = per_item(sweep_dir / "scores" / cell["id"])
        mine = mine_all.get(key, {})
        ctrl = [restoration(sft, dpo, c.get(key, {})) for c in controls]
        planted = cell["scores"].get(key, {})
        others = {n.removeprefix("judge:"): {"diff": e["vs_baseline"]["diff"], "p_holm": e["vs_baseline"]["p_holm"]}
                  for n, e in cell["scores"].items() if n.startswith("judge:") and n != key}
        changed = [n.removeprefix("judge:") for n, e in cell["scores"].items()
                   if n.startswith("judge:") and e["vs_baseline"]["p_holm"] < ALPHA]
        rows.append({"organism": organism.kind, "dimension": organism.dimension, "selector": selector,
                     "factor": cell["factor"],
                     "units": cell["units"], "top_k": cell["top_k"], "restoration": restoration(sft, dpo, mine),
                     "controls_restoration": [c["share"] for c in ctrl],
                     "controls_change": [c["cell_minus_dpo"] for c in ctrl],
                     "p_vs_baseline": planted.get("vs_baseline", {}).get("p_holm"),
                     "p_vs_controls": planted.get("vs_controls", {}).get("p_holm"),
                     "diff_vs_baseline": planted.get("vs_baseline", {}).get("diff"),
                     "max_logit_shift": cell.get("max_logit_shift"), "others": others, "changed": changed,
                     "toward_sft": toward_sft(sft_all, base_all, mine_all, controls)})
    return rows


def flag_restorations(rows: list[dict[str, Any]]) -> None:
    """Holm over one organism's cells x dimensions per comparison, then each row's `flagged`: the dimensions whose
    cases the cell brings closer to the SFT model's than both the baseline and its controls do (Holm p < ALPHA), its
    pass rate closer to SFT's too. On the planted organism that is the claim "these units hold the change"; on the
    null, any flag is a false positive."""
    from rolemrc.core.stats import holm

    for kind in {r["organism"] for r in rows}:
        mine = [r for r in rows if r["organism"] == kind]
        for family in ("vs_baseline", "vs_controls"):
            tests = [t[family] for r in mine for t in r["toward_sft"].values() if family in t]
            for test, adjusted in zip(tests, holm([t["p"] for t in tests])):
                test["p_holm"] = adjusted
        for r in mine:
            r["flagged"] = [d for d, t in r["toward_sft"].items()
                            if all(f in t and t[f]["diff"] < 0 and t[f]["p_holm"] < ALPHA
                                   and t["rate_gap"]["cell"] < t["rate_gap"][f.removeprefix("vs_")]
                                   for f in ("vs_baseline", "vs_controls"))]


def finds_change(row: dict[str, Any]) -> bool:
    """The cell undoes the planted change: restoration's CI above 0, and the planted dimension's cases closer to the
    SFT model's than under the baseline and under the controls (`flag_restorations`)."""
    return bool(row["restoration"]["lo"] > 0 and row["dimension"] in row["flagged"])


def headline(rows: list[dict[str, Any]], flags: dict[str, dict]) -> str:
    """Which selector, if any, finds the planted change and at what budget; the null's false-positive rate; whether
    the paper's factor 1 - 1e-6 changes anything."""
    planted = [r for r in rows if r["organism"] == "planted"]
    null = [r for r in rows if r["organism"] == "null"]
    found = [r for r in planted if finds_change(r)]
    best = {}
    for r in sorted(found, key=lambda r: r["units"]):
        best.setdefault(r["selector"], r)
    if best:
        parts = [f"{s} from {r['units']} units (x{r['factor']:g}: {r['restoration']['share']:.0%} undone, "
                 f"95% CI {r['restoration']['lo']:.0%} to {r['restoration']['hi']:.0%})" for s, r in best.items()]
        first = "The planted change is found by " + "; ".join(parts)
        missed = sorted({r["selector"] for r in planted} - set(best))
        first += f"; not by {', '.join(missed)}." if missed else "."
    else:
        first = (f"No selector finds the planted change: none of {len(planted)} cells brings the planted dimension's "
                 "cases and pass rate closer to the SFT model's than its baseline and its random-unit controls (Holm "
                 "p < 0.05) with restoration's CI above 0")
        scored = [r for r in planted if r["restoration"]["lo"] == r["restoration"]["lo"]]
        if scored:
            r = max(scored, key=lambda r: r["restoration"]["lo"])
            first += (f"; closest: {r['selector']} at {r['units']} units x{r['factor']:g}, "
                      f"{r['restoration']['share']:.0%} undone (95% CI {r['restoration']['lo']:.0%} to "
                      f"{r['restoration']['hi']:.0%}), Holm p {_p(r['p_vs_baseline'])} against the baseline and "
                      f"{_p(r['p_vs_controls'])} against the controls")
        first += "."
    paper = [r for r in rows if r["factor"] == PAPER_FACTOR]
    moved = [r for r in paper if r["changed"] or abs(r["restoration"]["cell_minus_dpo"]) > 0]
    fp, changed = sum(bool(r["flagged"]) for r in null), sum(bool(r["changed"]) for r in null)
    second = (f" Null organism: {fp} of {len(null)} cells flagged ({fp / len(null):.0%}, target <= 5%; flagged: a "
              f"dimension's cases and pass rate brought closer to the SFT model's than by the baseline and the "
              f"controls); {changed} changed some dimension against the baseline." if null else "")
    third = (f" The paper's factor 1 - 1e-6 changed the planted dimension's pass rate in {len(moved)} of {len(paper)} "
             "cells." if paper else "")
    return first + second + third


def calibrate(organisms: list[Organism], config: CalibrationConfig, *, cache: StageCache | None = None) -> dict:
    """Probe, select, restrain and score every organism over the grid; writes calibration.json/.md and the figure."""
    root = Path(config.out)
    cache = cache or StageCache(root)
    from rolemrc.intervene.spec import RestraintError

    rows, flags, sweep_dirs, timing, skipped = [], {}, {}, {}, {}
    for organism in organisms:
        folder = root / organism.kind
        inputs = probe_stages(cache, organism, config, folder)
        flags[organism.kind] = {tokens: diff_flags(inputs[tokens], organism.dimension) for tokens in ("last", "all")}
        for selector in config.selectors:
            source = inputs[SELECTOR_INPUTS[selector]]
            for suffix, (budgets, factors) in sweeps(config).items():
                key, sweep_dir = f"{organism.kind}/{selector}{suffix}", folder / f"sweep-{selector}{suffix}"
                started = time.perf_counter()
                try:
                    summary = sweep_stage(organism, selector, source, config, sweep_dir, budgets, factors)
                except RestraintError as exc:   # e.g. no unit moved in the selector's view: it restrains nothing
                    skipped[key] = str(exc)
                    continue
                cells = len(json.loads((sweep_dir / "plan.json").read_text())["cells"])
                timing[key] = {"seconds": round(time.perf_counter() - started, 1), "cells": cells}
                sweep_dirs[key] = str(sweep_dir)
                rows += cell_rows(organism, selector, summary, sweep_dir)
    flag_restorations(rows)
    null = [r for r in rows if r["organism"] == "null"]
    result = {"config": asdict(config), "organisms": [asdict(o) for o in organisms], "headline": headline(rows, flags),
              "diff_flags": flags, "cells": rows, "sweeps": sweep_dirs, "skipped": skipped, "timing": timing,
              "null_false_positive_rate": _rate(null, "flagged"), "null_changed_rate": _rate(null, "changed")}
    result["figure"] = calibration_figure(rows, root)
    write_json(root / "calibration.json", result)
    (root / "calibration.md").write_text(calibration_markdown(result))
    return result


def _rate(rows: list[dict[str, Any]], key: str) -> float | None:
    return sum(bool(r[key]) for r in rows) / len(rows) if rows else None


def calibration_markdown(result: dict[str, Any]) -> str:
    lines = [f"**{result['headline']}**", "", "| organism | selector | units | factor | undone (95% CI) | controls | "
             "p vs baseline | p vs controls | other dimensions (diff, Holm p) | closer to SFT |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["cells"]:
        s = r["restoration"]
        ctrl = ", ".join(f"{c:.0%}" for c in r["controls_restoration"]) or "-"
        others = "; ".join(f"{k} {v['diff']:+.2f} ({v['p_holm']:.2g})" for k, v in r["others"].items())
        lines.append(f"| {r['organism']} | {r['selector']} | {r['units']} | {r['factor']:g} | {s['share']:.0%} "
                     f"({s['lo']:.0%} to {s['hi']:.0%}) | {ctrl} | {_p(r['p_vs_baseline'])} | {_p(r['p_vs_controls'])} "
                     f"| {others} | {', '.join(r['flagged']) or '-'} |")
    lines += ["", "Units the diffs flag by themselves (BH q < 0.05, planted dimension): "
              + "; ".join(f"{k} {t}: frequency {v['frequency']}, effect {v['effect']}"
                          for k, d in result["diff_flags"].items() for t, v in d.items())]
    return "\n".join(lines) + "\n"


def _p(p: float | None) -> str:
    return "-" if p is None else f"{p:.2g}"


def calibration_figure(rows: list[dict[str, Any]], out: Path) -> dict[str, str]:
    """Per organism a panel of one line per selector and factor (a colour per selector in every panel; factor 0
    solid, others dashed) against units restrained, the random-unit controls as a grey band (lowest to highest at
    each size), flagged cells (`flag_restorations`) as stars. planted: the share of the change undone (95% CI);
    null, which has no change to undo: the change in the planted dimension's pass rate."""
    import plotly.graph_objects as go
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    from rolemrc.core.figures import write_figure

    kinds = sorted({r["organism"] for r in rows}, key=lambda k: k != "planted")
    color = {s: qualitative.Plotly[k % len(qualitative.Plotly)] for k, s in enumerate(sorted({r["selector"] for r in rows}))}
    titles = [f"{k}: share of the planted change undone" if k == "planted" else f"{k}: change in pass rate vs DPO"
              for k in kinds]
    fig = make_subplots(rows=1, cols=len(kinds), subplot_titles=titles)
    for col, kind in enumerate(kinds, 1):
        mine = [r for r in rows if r["organism"] == kind]
        share = kind == "planted"
        value = (lambda r: r["restoration"]["share"]) if share else (lambda r: r["restoration"]["cell_minus_dpo"])
        controls = "controls_restoration" if share else "controls_change"
        units = sorted({r["units"] for r in mine})
        band = [[c for r in mine if r["units"] == u for c in r[controls] if c == c] or [0.0] for u in units]
        fig.add_trace(go.Scatter(x=units + units[::-1], y=[max(c) for c in band] + [min(c) for c in band][::-1],
                                 fill="toself", fillcolor="rgba(120,120,120,0.3)", line={"width": 1, "color": "grey"},
                                 name="random-unit controls", showlegend=col == 1, hoverinfo="skip"), 1, col)
        for selector in sorted({r["selector"] for r in mine}):
            for factor in sorted({r["factor"] for r in mine}):
                line = sorted((r for r in mine if r["selector"] == selector and r["factor"] == factor),
                              key=lambda r: r["units"])
                ys = [value(r) for r in line]
                error = ({"type": "data", "symmetric": False,
                          "array": [r["restoration"]["hi"] - y for r, y in zip(line, ys)],
                          "arrayminus": [y - r["restoration"]["lo"] for r, y in zip(line, ys)]} if share else None)
                fig.add_trace(go.Scatter(x=[r["units"] for r in line], y=ys, mode="lines+markers",
                                         name=f"{selector} x{factor:g}", legendgroup=f"{selector}{factor}",
                                         showlegend=col == 1,
                                         marker={"color": color[selector],
                                                 "symbol": ["star" if r["flagged"] else "circle" for r in line],
                                                 "size": [14 if r["flagged"] else 7 for r in line]},
                                         hovertext=[f"flagged: {', '.join(r['flagged'])}" if r["flagged"] else
                                                    "not flagged" for r in line],
                                         line={"dash": "solid" if factor == 0 else "dash", "color": color[selector]},
                                         error_y=error), 1, col)
        fig.update_xaxes(type="log", title_text="units restrained", row=1, col=col)
    fig.update_layout(template="plotly_white", margin={"t": 110},
                      title="Calibration: does restraining a selector's units undo a known change?<br><sup>stars: "
                            "flagged (a dimension's cases and pass rate brought back toward the SFT model's beyond the "
                            "baseline and the controls)</sup>")
    return write_figure(fig, out, "calibration", plotlyjs=True)


def run(out: Path, *, base: str = "smollm2", quick: bool = False, probe_n: int | None = None,
        organism_overrides: dict[str, Any] | None = None, organisms_dir: Path | None = None,
        hook: str = "mlp.act") -> dict:
    """Build both organisms from `base` under `organisms_dir` (default out/organisms; cached there, so a folder that
    `rolemrc organism build` filled with the same settings is reused), then calibrate; the bench's JSON."""
    from rolemrc.organism import OrganismConfig, build_organism
    from rolemrc.organism.config import QUICK as ORGANISM_QUICK

    config = CalibrationConfig(out=str(out), hook=hook, **(QUICK if quick else {}))   # checked before any work
    started = time.perf_counter()
    cache = StageCache(out)
    settings = {**(ORGANISM_QUICK if quick else ORGANISMS), **(organism_overrides or {})}
    probe_n = probe_n or (QUICK_PROBE_CASES if quick else 48)
    folder = organisms_dir or out / "organisms"
    reports = {kind: build_organism(OrganismConfig(kind=kind, out=str(folder), base=base, **settings))
               for kind in ("planted", "null")}
    trained = {p["id"] for r in reports.values() for p in read_jsonl(r["pairs"])}
    probe = out / "probe-cases.jsonl"
    source = folder / "data" / "pairs.jsonl"
    cache.run("probe cases", {"pairs": source, "trained": sorted(trained), "n": probe_n},
              lambda: {"cases": write_jsonl(probe, probe_cases(source, trained, probe_n, 0))}, [probe])
    organisms = [Organism.from_report(reports[k], probe) for k in ("planted", "null")]
    result = calibrate(organisms, config, cache=cache)
    cells = sum(t["cells"] for t in result["timing"].values())
    grid_seconds = sum(t["seconds"] for t in result["timing"].values())
    return {"headline": result["headline"], "quick": quick,
            "organisms": {k: {"headline": r["headline"], "meets_target": r["meets_target"],
                              "training_seconds": r["training"]["seconds"]} for k, r in reports.items()},
            "null_false_positive_rate": result["null_false_positive_rate"], "diff_flags": result["diff_flags"],
            "cells_generated": cells, "grid_seconds": grid_seconds,
            "cells_per_minute": round(60 * cells / grid_seconds, 2) if grid_seconds else None,
            "seconds": round(time.perf_counter() - started, 1), "stage_seconds": cache.timings,
            "calibration": str(out / "calibration.json"), "figure": result["figure"]}


__all__ = ["CalibrationConfig", "Organism", "calibrate", "restoration", "run"]
