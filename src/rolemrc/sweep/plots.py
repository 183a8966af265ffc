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


FRONTIER_FLOOR = -1.5   # restorations below this (a restraint pushing the model well past DPO) are listed, not drawn


def frontier_figures(summary: dict) -> dict:
    """The frontier: restoration on the dimension against size (neutral KL from the DPO model, log scale), one curve
    per family with 95% CIs, its controls as open markers and their band (min to max at each point); and, given
    preference pairs, restoration against the share of DPO's margin kept."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    points = summary["points"]
    margins = all("margin_kept" in p for p in points)
    fig = make_subplots(rows=1, cols=2 if margins else 1, horizontal_spacing=0.1,
                        subplot_titles=["restoration vs size", "restoration vs DPO margin kept"][:2 if margins else 1])
    families = list(dict.fromkeys(p["family"] for p in points))
    for k, family in enumerate(families):
        row = sorted((p for p in points if p["family"] == family), key=lambda p: p["size"]["mean"])
        color = f"hsl({(k * 67) % 360}, 65%, 42%)"
        x, y = [p["size"]["mean"] for p in row], [p["restoration"]["mean"] for p in row]
        err = {"type": "data", "symmetric": False, "array": [p["restoration"]["hi"] - p["restoration"]["mean"] for p in row],
               "arrayminus": [p["restoration"]["mean"] - p["restoration"]["lo"] for p in row]}
        label = [", ".join(f"{key} {p[key]:g}" for key in ("per_layer", "factor", "alpha", "top_layers") if key in p)
                 for p in row]
        if all("controls" in p for p in row):
            if len(row) > 1:   # the band: min to max of the controls at each point
                top = [max(p["controls"]["restoration"]) for p in row]
                bottom = [min(p["controls"]["restoration"]) for p in row]
                fig.add_trace(go.Scatter(x=x + x[::-1], y=top + bottom[::-1], fill="toself", line={"width": 0},
                                         fillcolor=color.replace("hsl", "hsla").replace(")", ", 0.15)"),
                                         hoverinfo="skip", showlegend=False, legendgroup=family), row=1, col=1)
            fig.add_trace(go.Scatter(x=[s for p in row for s in p["controls"]["size"]],
                                     y=[v for p in row for v in p["controls"]["restoration"]], mode="markers",
                                     marker={"color": color, "symbol": "circle-open", "size": 6, "opacity": 0.6},
                                     name=f"{family}: controls", legendgroup=family,
                                     hovertemplate="control<br>KL %{x:.3g}<br>restoration %{y:.3f}<extra>"
                                     + family + "</extra>"), row=1, col=1)
        fig.add_trace(go.Scatter(x=x, y=y, error_y=err, mode="lines+markers", name=family, legendgroup=family,
                                 line={"color": color}, text=label, hovertemplate="%{text}<br>KL %{x:.3g}<br>"
                                 "restoration %{y:.3f}<extra>" + family + "</extra>"), row=1, col=1)
        if margins:
            fig.add_trace(go.Scatter(x=[p["margin_kept"]["mean"] for p in row], y=y, mode="markers", showlegend=False,
                                     marker={"color": color}, legendgroup=family, text=label,
                                     hovertemplate="%{text}<br>margin kept %{x:.3f}<br>restoration %{y:.3f}"
                                     "<extra>" + family + "</extra>"), row=1, col=2)
    floor = FRONTIER_FLOOR
    below = [f"{p['family']} ({', '.join(f'{k} {p[k]:g}' for k in ('per_layer', 'alpha', 'top_layers') if k in p)}): "
             f"{p['restoration']['mean']:.2f}" for p in points if p["restoration"]["mean"] < floor]
    if below or any(min(p.get("controls", {}).get("restoration") or [0]) < floor for p in points):
        fig.update_yaxes(range=[floor, 1.1])
        fig.add_annotation(text="below the axis: " + ("; ".join(below) or "controls only"), xref="paper", yref="paper",
                           x=0, y=-0.16, showarrow=False, align="left", font={"size": 11})
    fig.update_xaxes(type="log", title_text="size: KL from the DPO model on neutral texts (per token)", row=1, col=1)
    fig.update_yaxes(title_text=f"restoration on {summary['config']['dimension']} (share of DPO's KL undone)",
                     row=1, col=1)
    if margins:
        fig.update_xaxes(title_text="share of DPO's reward margin kept (held-out pairs)", row=1, col=2)
    fig.add_hline(y=0, line_dash="dot", line_color="grey")
    fig.update_layout(title="Restraint frontier: every kind on one pair (95% CIs over cases; bands: controls)",
                      template="plotly_white", width=1300 if margins else 900, height=600, margin={"b": 110})
    return fig


def frontier_figure(summary: dict, out: str | Path) -> dict[str, dict[str, str]]:
    return write_figures({"frontier": frontier_figures(summary)}, Path(out))
