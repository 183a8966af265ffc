"""The calibration's report: the headline sentence, calibration.md's table and the figure (calibration.html/png)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rolemrc.intervene.budget import Budget, coverage_text
from rolemrc.intervene.recommendation import RECOMMENDATION
from rolemrc.intervene.spec import PAPER_FACTOR
from rolemrc.organism.scoring import finds_change


def headline(rows: list[dict[str, Any]]) -> str:
    """Which selector, if any, finds the planted change and at what budget; the null's false-positive rate; whether
    the paper's factor 1 - 1e-6 changes anything."""
    planted = [r for r in rows if r["organism"] == "planted"]
    null = [r for r in rows if r["organism"] == "null"]
    found = [r for r in planted if finds_change(r)]
    best = {}
    for r in sorted(found, key=lambda r: r["units"]):
        best.setdefault(r["selector"], r)
    if best:
        parts = [f"{s} from {coverage_text(r['coverage'])} (x{r['factor']:g}: {r['restoration']['share']:.0%} undone, "
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
            first += (f"; closest: {r['selector']} at {coverage_text(r['coverage'])} x{r['factor']:g}, "
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


def recommendation_text(rec: dict[str, Any]) -> str:
    """One line on what `intervene select --calibration` takes from this calibration, or why it refuses."""
    if rec["status"] != "found":
        return f"No recommendation ({rec['status']}): {rec['why']}. `intervene select --calibration` refuses it."
    return (f"Recommended: {rec['selector']} x{rec['factor']:g} at {Budget.of(rec['budget']).label} "
            f"({rec['why']}); `intervene select --calibration` takes it. It rests on {_settings(rec['rests_on'])}.")


def _settings(rests_on: dict[str, Any]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in rests_on.items() if v is not None) or "nothing recorded"


def calibration_markdown(result: dict[str, Any]) -> str:
    lines = [f"**{result['headline']}**", "", recommendation_text(result[RECOMMENDATION]), "",
             "| organism | selector | units (share of all; per layer) | factor | undone (95% CI) | controls | "
             "p vs baseline | p vs controls | other dimensions (diff, Holm p) | closer to SFT |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["cells"]:
        s = r["restoration"]
        ctrl = ", ".join(f"{c:.0%}" for c in r["controls_restoration"]) or "-"
        others = "; ".join(f"{k} {v['diff']:+.2f} ({v['p_holm']:.2g})" for k, v in r["others"].items())
        lines.append(f"| {r['organism']} | {r['selector']} | {coverage_text(r['coverage'])} | {r['factor']:g} | {s['share']:.0%} "
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
