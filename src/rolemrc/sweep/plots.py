"""The sweep's figures (Plotly HTML + PNG): dose-response per dimension, and cells x scores effects."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from rolemrc.core.figures import write_figures
from rolemrc.intervene.budget import Budget
from rolemrc.sweep.report import ALPHA, cell_label
from rolemrc.sweep.stats import COMPARISONS, MEASURE_SCORES, is_primary

SELECTED_COLOR, CONTROLS_COLOR = (31, 119, 180), (110, 110, 110)   # the selected units' blue, the controls' grey
CONTROLS_DODGE = 0.02   # the controls drawn this share of the factors' range to the right: equal CIs stay apart


def ci_traces(x: list[float], entries: list[dict], key: str, color: tuple[int, int, int], name: str, *,
              legend: bool, shift: float = 0.0) -> list:
    """A mean line (`entries[i][key + "mean"]` at `x[i]`, drawn `shift` to the right) with each point's 95% CI as an
    error bar and, across the points, as a shaded band (`key + "lo"` to `key + "hi"`), both in `color`; the band is
    named `name` + ": 95% CI"."""
    import plotly.graph_objects as go

    mean, lo, hi = ([e[key + part] for e in entries] for part in ("mean", "lo", "hi"))
    rgb = ", ".join(map(str, color))
    at = [v + shift for v in x]
    band = go.Scatter(x=at + at[::-1], y=hi + lo[::-1], mode="lines", fill="toself", fillcolor=f"rgba({rgb}, 0.2)",
                      line={"width": 0}, hoverinfo="skip", name=f"{name}: 95% CI", legendgroup=name, showlegend=False)
    line = go.Scatter(x=at, y=mean, mode="lines+markers", name=name, legendgroup=name, showlegend=legend,
                      line={"color": f"rgb({rgb})", "dash": "dash" if key else "solid"},
                      error_y={"type": "data", "symmetric": False, "array": [h - m for h, m in zip(hi, mean)],
                               "arrayminus": [m - v for m, v in zip(mean, lo)], "color": f"rgb({rgb})",
                               "thickness": 1.5, "width": 5},
                      customdata=list(zip(x, lo, hi)), hovertemplate="factor %{customdata[0]:g}<br>mean %{y:.3f} "
                      "[%{customdata[1]:.3f}, %{customdata[2]:.3f}]<extra>" + name + "</extra>")
    return [band, line]


def dose_response(summary: dict, dimension: str):
    """For the cells selected on `dimension`: the measure's primary score on it (the judge pass share or the
    restoration; when the test set has none on it, on the first dimension that has one) against the factor, a panel
    per budget: the cells' mean and the mean of their random-unit controls (per case, over the draws), each with its
    95% bootstrap CI over cases as error bars and a shaded band, and the baseline flat."""
    from plotly.subplots import make_subplots

    prefix, what = MEASURE_SCORES[summary["config"]["measure"]]
    cells = [c for c in summary["cells"] if c["dimension"] == dimension]
    judged = sorted({n for c in cells for n in c["scores"] if n.startswith(prefix)})
    score = prefix + dimension if prefix + dimension in judged else (judged or [prefix + dimension])[0]
    cells = [c for c in cells if score in c["scores"]]
    groups: dict[Budget, list[dict]] = {}
    for cell in sorted(cells, key=lambda c: c["units"]):   # budgets by size
        groups.setdefault(Budget.of(cell["budget"]), []).append(cell)
    fig = make_subplots(rows=1, cols=max(len(groups), 1), shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=[f"{b.label}" + (f" ({span(c['units'] for c in row)} units)" if row[0]["units"]
                                                         else "") for b, row in groups.items()])
    controls = bool(cells) and all("controls_mean" in c["scores"][score] for c in cells)
    factors = [c["factor"] for c in cells]
    dodge = CONTROLS_DODGE * ((max(factors) - min(factors)) or 1) if cells else 0.0
    series = [("controls_", CONTROLS_COLOR, f"random-unit controls (mean of {summary['config']['controls']} draws)",
               dodge)] if controls else []
    for col, row in enumerate(groups.values(), 1):
        row = sorted(row, key=lambda c: c["factor"])
        pairs = [ci_traces([c["factor"] for c in row], [c["scores"][score] for c in row], key, color, name,
                           legend=col == 1, shift=shift)
                 for key, color, name, shift in [*series, ("", SELECTED_COLOR, "selected units", 0.0)]]
        for trace in [band for band, _ in pairs] + [line for _, line in pairs]:   # every band under every line
            fig.add_trace(trace, row=1, col=col)
        fig.update_xaxes(title_text="factor (1 = unrestrained, 0 = ablated)", row=1, col=col)
    if score in summary["baseline"]:
        fig.add_hline(y=summary["baseline"][score], line_dash="dot", annotation_text="baseline")
    band = (f"lines: means over {span(c['scores'][score]['n'] for c in cells)} cases; bars and shading: 95% bootstrap "
            "CI over cases<br>" + ("grey: random-unit controls (drawn a little to the right); " if controls else "")
            + "dotted: unrestrained baseline")
    fig.update_layout(title={"text": f"units of {dimension}: {score.removeprefix(prefix)} {what} vs factor",
                             "subtitle": {"text": band}},
                      yaxis_title=what, template="plotly_white", margin={"t": 140},
                      legend={"orientation": "h", "yanchor": "top", "y": -0.18, "x": 0})
    return fig


def span(values: Iterable[int]) -> str:
    """'72', or '70-72' where the values differ."""
    ordered = sorted(set(values))
    return f"{ordered[0]}" if len(ordered) == 1 else f"{ordered[0]}-{ordered[-1]}"


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
