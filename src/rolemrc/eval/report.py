"""Reports: Markdown tables shaped like the RoleMRC paper's Table 3 (metrics and judge aspects per
model) and Table 6 (before/after per dimension), and a Plotly bar chart with CI error bars."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rolemrc.core.figures import write_figure
from rolemrc.core.stats import TEST_LABELS
from rolemrc.core.taxonomy import DIMENSIONS
from rolemrc.eval.aggregate import AVERAGES
from rolemrc.eval.metrics import metric_scale


def fmt(stat: dict | None, scale: float = 100.0) -> str:
    """`mean [lo, hi]` scaled to percent (metrics already on 0-100 use scale 1)."""
    if not stat or stat.get("mean") is None or math.isnan(stat["mean"]):
        return "–"
    text = f"{stat['mean'] * scale:.1f}"
    if "lo" in stat and not math.isnan(stat["lo"]):
        text += f" [{stat['lo'] * scale:.1f}, {stat['hi'] * scale:.1f}]"
    return text


def table3(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """One row per run: reference metrics, judge dimensions, the three averages and the share of damaged replies
    (percent, 95% CI)."""
    metrics = list(dict.fromkeys(m for _, s in runs for m in s.get("metrics", {})))  # first-seen (registration) order
    head = ["run", *metrics, *DIMENSIONS, *AVERAGES, "damaged"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in runs:
        agg = s.get("judge_aggregates", {})
        cells = [name, *(fmt(s.get("metrics", {}).get(m), metric_scale(m)) for m in metrics),
                 *(fmt(agg.get("dimensions", {}).get(d)) for d in DIMENSIONS),
                 *(fmt(agg.get("averages", {}).get(a)) for a in AVERAGES), fmt(agg.get("damaged"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_markdown(summary: dict[str, Any], name: str) -> str:
    agg = summary.get("judge_aggregates", {})
    parts = [f"# Eval run `{name}`", "",
             f"{summary.get('n_items', 0)} items"
             + (f" (`--limit {summary['limit']}`: the first of the data, a quick run)" if "limit" in summary else "")
             + f"; judge `{summary.get('judge', {}).get('name')}`: "
             f"{agg.get('calls', 0)} calls, {agg.get('scored', 0)} scored, status {agg.get('status', {})}. "
             f"Values in percent (BLEU 0-100) with bootstrap 95% CIs ({summary.get('bootstrap_rounds')} rounds; "
             "judge scores: items resampled within their task).", "",
             "## Table 3 shape", "", table3([(name, summary)]), ""]
    if agg.get("damaged", {}).get("n"):
        kinds = ", ".join(f"{k} {n}" for k, n in agg["damaged"]["kinds"].items()) or "none"
        parts += [f"Damaged replies (empty, degenerate or in the wrong language; each fails every aspect unjudged): "
                  f"{fmt(agg['damaged'])} of {agg['damaged']['n']} items ({kinds}).", ""]
    if agg.get("aspects"):
        parts += ["## Aspects", "", "| aspect | score | calls |", "|---|---|---|",
                  *(f"| {k} | {fmt(v)} | {v['n']} |" for k, v in agg["aspects"].items()), ""]
    if agg.get("tasks"):
        parts += ["## Tasks", "", "| task | score | calls |", "|---|---|---|",
                  *(f"| {k} | {fmt(v)} | {v['n']} |" for k, v in agg["tasks"].items()), ""]
    notes = [f"- {k}: {v}" for k, v in summary.get("metric_info", {}).items()]
    notes += [f"- {k} not computed: {v}" for k, v in summary.get("metrics_unavailable", {}).items()]
    if agg.get("averages_note"):
        notes.append(f"- {agg['averages_note']}")
    if agg.get("bootstrap", {}).get("resamples_lacking_dimension"):
        notes.append(f"- {agg['bootstrap']['resamples_lacking_dimension']} bootstrap resamples lacked a dimension")
    if summary.get("unjudged_tasks"):
        notes.append(f"- tasks with no judge aspect (unknown names): {summary['unjudged_tasks']}")
    if summary.get("chart", {}).get("png_error"):
        notes.append(f"- PNG chart not written: {summary['chart']['png_error']}")
    if notes:
        parts += ["## Notes", "", *notes, ""]
    return "\n".join(parts)


def write_chart(runs: list[tuple[str, dict[str, Any]]], stem: str | Path) -> dict[str, str]:
    """Grouped bars (judge dimensions and averages, percent) with CI error bars: HTML, and PNG when
    kaleido finds Chromium; a missing browser is reported in the result, not raised."""
    import plotly.graph_objects as go

    keys = [*DIMENSIONS, *AVERAGES]
    fig = go.Figure()
    for name, s in runs:
        agg = s.get("judge_aggregates", {})
        stats = [agg.get("dimensions", {}).get(k) or agg.get("averages", {}).get(k) or {} for k in keys]
        mean = [100 * st.get("mean", math.nan) for st in stats]
        fig.add_bar(name=name, x=keys, y=mean, error_y={
            "type": "data", "symmetric": False,
            "array": [100 * st.get("hi", math.nan) - m for st, m in zip(stats, mean)],
            "arrayminus": [m - 100 * st.get("lo", math.nan) for st, m in zip(stats, mean)]})
    fig.update_layout(barmode="group", title="Judge scores with bootstrap 95% CIs", yaxis_title="score (%)",
                      yaxis_range=[0, 105], template="plotly_white")
    stem = Path(stem)
    return write_figure(fig, stem.parent, stem.name, plotlyjs=True, width=1000, height=500)


def _p(p: float) -> str:
    return "–" if p is None or math.isnan(p) else (f"{p:.3g}" if p >= 1e-4 else "<1e-4")


def costliest_lines(cost: dict | None) -> list[str]:
    """compare.md's verdict on the dimension B cost most (the one a restraint should give back), and how sure it is."""
    if cost is None:
        return []
    change = f"{100 * cost['diff']:+.1f} points [{100 * cost['lo']:+.1f}, {100 * cost['hi']:+.1f}], McNemar p {_p(cost['p'])}"
    if cost["excludes_zero"]:
        verdict = "its CI excludes 0: restrain toward this dimension"
    elif cost["diff"] < 0:
        verdict = "its CI includes 0: no dimension's cost is measurable on these items"
    else:
        verdict = "no dimension fell: B cost nothing on the judge"
    return [f"**Costliest dimension: {cost['dimension']}**, {change}; {verdict}.", ""]


def compare_markdown(comparison) -> str:
    """Table 6 shape: per dimension before (A) / after (B) / change, McNemar p and odds ratio; then metrics."""
    lines = [f"# Compare `{comparison.a}` (A) -> `{comparison.b}` (B)", "",
             f"{comparison.shared_items} shared items. Judge: exact McNemar on paired verdicts "
             "(improved = 0 -> 1, worsened = 1 -> 0). Metrics: mean(B - A) with a paired bootstrap 95% CI and a "
             "two-sided sign-flip permutation p (exact over all 2^n flips up to n = 16 nonzero differences, "
             "else Monte Carlo with (hits + 1) / (rounds + 1)).", "",
             *costliest_lines(comparison.costliest()),
             "## Table 6 shape", "",
             "| dimension | A | B | change [95% CI, items resampled] | improved | worsened | odds ratio | p (McNemar) | pairs |",
             "|---|---|---|---|---|---|---|---|---|"]
    for dim, r in comparison.verdicts.items():
        lines.append(f"| {dim} | {100 * r['a_rate']:.1f} | {100 * r['b_rate']:.1f} | {100 * r['diff']:+.1f} "
                     f"[{100 * r['lo']:+.1f}, {100 * r['hi']:+.1f}] | {r['improved']} | {r['worsened']} | "
                     f"{r['odds_ratio']:.2f} | {_p(r['p'])} | {r['n']} |")
    if comparison.damaged:
        r = comparison.damaged
        lines += ["", "## Damaged replies", "", "Items whose reply is empty, degenerate or in the wrong language "
                  "(each fails every aspect unjudged); exact McNemar.", "",
                  "| A | B | change | newly damaged | repaired | p (McNemar) | items |", "|---|---|---|---|---|---|---|",
                  f"| {100 * r['a_rate']:.1f} | {100 * r['b_rate']:.1f} | {100 * r['diff']:+.1f} | {r['improved']} | "
                  f"{r['worsened']} | {_p(r['p'])} | {r['n']} |"]
    if comparison.metrics:
        lines += ["", "## Reference metrics", "",
                  "| metric | A | B | change [95% CI] | Cohen's d_z | p (sign-flip) | test |", "|---|---|---|---|---|---|---|"]
        for name, r in comparison.metrics.items():
            s = metric_scale(name)
            lines.append(f"| {name} | {s * r['a_mean']:.2f} | {s * r['b_mean']:.2f} | {s * r['diff']:+.2f} "
                         f"[{s * r['lo']:+.2f}, {s * r['hi']:+.2f}] | {r['cohen_dz']:.2f} | {_p(r['p'])} | "
                         f"{TEST_LABELS[r['test']]} ({r['p_method']}) |")
    return "\n".join(lines) + "\n"
