"""The sweep's figures (Plotly HTML + PNG): dose-response per dimension, and cells x scores effects."""

from __future__ import annotations

from pathlib import Path

from rolemrc.core.figures import write_figures
from rolemrc.intervene.budget import Budget
from rolemrc.sweep.report import ALPHA, cell_label
from rolemrc.sweep.stats import COMPARISONS, MEASURE_SCORES, is_primary


def dose_response(summary: dict, dimension: str):
    """For the cells selected on `dimension`: the measure's primary score on it (the judge pass share or the
    restoration; when the test set has none on it, on the first dimension that has one) against the factor, one line
    per budget with its 95% CI band (paired against the baseline), the mean of its random-unit controls dashed, the
    baseline flat."""
    import plotly.graph_objects as go

    prefix, what = MEASURE_SCORES[summary["config"]["measure"]]
    cells = [c for c in summary["cells"] if c["dimension"] == dimension]
    judged = sorted({n for c in cells for n in c["scores"] if n.startswith(prefix)})
    score = prefix + dimension if prefix + dimension in judged else (judged or [prefix + dimension])[0]
    cells = [c for c in cells if score in c["scores"]]
    fig = go.Figure()
    budgets = sorted({Budget.of(c["budget"]) for c in cells}, key=lambda b: min(c["units"] for c in cells
                                                                                  if Budget.of(c["budget"]) == b))
    for k, budget in enumerate(budgets):
        row = sorted((c for c in cells if Budget.of(c["budget"]) == budget), key=lambda c: c["factor"])
        x = [c["factor"] for c in row]
        tests = [c["scores"][score]["vs_baseline"] for c in row]
        color = f"hsl({(k * 67) % 360}, 65%, 45%)"
        upper, lower = [t["a_mean"] + t["hi"] for t in tests], [t["a_mean"] + t["lo"] for t in tests]
        fig.add_trace(go.Scatter(x=x + x[::-1], y=upper + lower[::-1],
                                 fill="toself", fillcolor=color.replace("hsl", "hsla").replace(")", ", 0.15)"),
                                 line={"width": 0}, hoverinfo="skip", showlegend=False))
        fig.add_trace(go.Scatter(x=x, y=[c["scores"][score]["mean"] for c in row], mode="lines+markers",
                                 name=budget.label, line={"color": color}))
        if all("controls_mean" in c["scores"][score] for c in row):
            fig.add_trace(go.Scatter(x=x, y=[c["scores"][score]["controls_mean"] for c in row], mode="lines",
                                     name=f"{budget.label} random controls", line={"color": color, "dash": "dash"}))
    if score in summary["baseline"]:
        fig.add_hline(y=summary["baseline"][score], line_dash="dot", annotation_text="baseline")
    fig.update_layout(title=f"units of {dimension}: {score.removeprefix(prefix)} {what} vs factor "
                            "(95% CI bands; dashed: random units)",
                      xaxis_title="factor (1 = unrestrained, 0 = ablated)", yaxis_title=what, template="plotly_white")
    return fig


def effects_heatmap(summary: dict, family: str):
    """Cells x scores: the effect (`vs_baseline` or `vs_controls`), centred at 0, * where Holm p < ALPHA."""
    import plotly.graph_objects as go

    cells = summary["cells"]
    names = sorted({n for c in cells for n in c["scores"]}, key=lambda n: (not is_primary(n), n))
    labels = [cell_label(c) for c in cells]
    tests = [[c["scores"].get(n, {}).get(family) for n in names] for c in cells]
    z = [[t["diff"] if t else None for t in row] for row in tests]
    text = [[f"{t['diff']:+.3f}{' *' if t['p_holm'] < ALPHA else ''}" if t else "" for t in row] for row in tests]
    fig = go.Figure(go.Heatmap(z=z, x=names, y=labels, text=text, texttemplate="%{text}", colorscale="RdBu",
                               zmid=0, colorbar={"title": "effect"}))
    fig.update_layout(title=f"effect {family.replace('_', ' ')} (paired per item; * Holm p < {ALPHA})",
                      yaxis={"autorange": "reversed"}, template="plotly_white")
    return fig


def write_sweep_figures(summary: dict, out: str | Path) -> dict[str, dict[str, str]]:
    out = Path(out)
    return write_figures({**{f"effects_{family}": effects_heatmap(summary, family) for family in COMPARISONS},
                          **{f"dose_{dimension}": dose_response(summary, dimension)
                             for dimension in sorted({c["dimension"] for c in summary["cells"]})}}, out)
