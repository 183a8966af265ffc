"""Heatmaps of a diff as Plotly HTML (sharing one plotly.min.js) and PNG (kaleido + Chromium)."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from rolemrc.core.figures import write_figures
from rolemrc.probe.diff import DiffResult


def layer_heatmap(z: torch.Tensor, x: list[str], *, across: str, title: str, colorscale: str, hover: str | None = None):
    """Mean |Δfreq| per layer (rows) and `across` (columns, labelled `x`; `hover` names a column on hover)."""
    import plotly.graph_objects as go

    fig = go.Figure(go.Heatmap(z=z.tolist(), x=x, y=list(range(z.shape[0])), colorscale=colorscale,
                               colorbar={"title": "mean |Δfreq|"},
                               hovertemplate=f"{hover or across} %{{x}}<br>layer %{{y}}<br>mean |Δ| %{{z:.4f}}<extra></extra>"))
    fig.update_layout(title=title, xaxis_title=across, yaxis_title="layer", template="plotly_white",
                      xaxis_type="category", yaxis_dtick=1)
    return fig


def layers_by_dimensions(result: DiffResult):
    """Mean |delta| per layer (rows) and dimension (columns)."""
    dims = result.dimensions
    z = torch.stack([result.delta[d].abs().mean(1) for d in dims], dim=1)  # [layers, dims]
    return layer_heatmap(z, dims, across="dimension", colorscale="Viridis",
                         title=f"{result.hook}: mean |freq_b − freq_a| per layer and dimension")


def unit_bins(delta: torch.Tensor, bins: int) -> torch.Tensor:
    """Mean |delta| over contiguous unit-index bins: [layers, width] -> [layers, bins]."""
    layers, width = delta.shape
    bins = min(bins, width)
    index = torch.arange(width) * bins // width
    sums = torch.zeros(layers, bins, dtype=torch.float64).index_add_(1, index, delta.abs().double())
    sizes = torch.bincount(index, minlength=bins).double()
    return sums / sizes


def layers_by_unit_bins(result: DiffResult, dimension: str, bins: int = 64):
    """Mean |delta| per layer (rows) and contiguous bin of unit indices (columns)."""
    delta = result.delta[dimension]
    z = unit_bins(delta, bins)
    width = delta.shape[1]
    starts = [b * width // z.shape[1] for b in range(z.shape[1] + 1)]
    edges = [str(lo) if hi - lo == 1 else f"{lo}-{hi - 1}" for lo, hi in itertools.pairwise(starts)]
    return layer_heatmap(z, edges, across="unit index bin", hover="units", colorscale="Magma",
                         title=f"{dimension} · {result.hook}: mean |Δfreq| per layer and unit bin")


def write_heatmaps(result: DiffResult, out_dir: str | Path, bins: int = 64) -> dict[str, dict[str, str]]:
    """All heatmaps of a diff into out_dir; returns {figure name: written paths}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not result.dimensions:
        return {}
    stems = {"layers_x_dimensions": "heatmap_layers_dimensions", **{f"units_{d}": f"heatmap_units_{d}"
                                                                    for d in result.dimensions}}
    written = write_figures({"heatmap_layers_dimensions": layers_by_dimensions(result),
                             **{f"heatmap_units_{d}": layers_by_unit_bins(result, d, bins) for d in result.dimensions}},
                            out)
    return {name: written[stem] for name, stem in stems.items()}
