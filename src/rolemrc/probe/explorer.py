"""`rolemrc probe explore --diff DIFF_DIR --out explorer.html`: one self-contained interactive Plotly page.

Pick a dimension; see the layer-by-layer shift; click a layer to see its units (frequency under A vs B,
delta, FDR-significant units highlighted); preview which units `intervene select` picks for given layers,
direction and top-k or q < fdr. The page embeds units in `ranking.rank_units` order and only filters them, so the
preview is `select`'s choice: exactly for top-k <= max_units, and for q < fdr where at most max_units per layer
and sign qualify (else the page says how many qualify).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from rolemrc.probe.diff import DiffResult, load_diff
from rolemrc.probe.errors import ProbeError
from rolemrc.probe.ranking import first_per_group, moved, rank_units

TEMPLATE = Path(__file__).with_name("templates") / "explorer.html"
DIGITS = 6  # significant digits of the values in the page: a tiny q keeps its digits, never shows as 0


def significant(values: torch.Tensor, digits: int = DIGITS) -> list:
    """`values` as (nested) lists, rounded to `digits` significant digits; 0, NaN, infinities and values too small to
    scale (subnormal) are kept as they are."""
    x = values.double()
    scale = torch.pow(10.0, digits - 1 - torch.floor(torch.log10(x.abs())))
    rounded = torch.round(x * scale) / scale
    return torch.where(torch.isfinite(rounded) & (rounded != 0), rounded, x).tolist()


def explorer_data(result: DiffResult, max_units: int = 512, fdr: float = 0.05) -> dict:
    """The JSON the page runs on, per dimension: per-layer summaries, each layer's `max_units` most changed units (the
    panels) and, in rank order, the units the preview picks from: per layer and sign (up, down), the `max_units` most
    changed and the `max_units` most changed with q < fdr."""
    dims = {}
    for d in result.dimensions:
        delta, q = result.delta[d], result.qvalue[d].double()
        layers, width = delta.shape
        flat_delta, sig = delta.reshape(-1), (q < fdr).reshape(-1)
        layer_of = torch.arange(layers).repeat_interleave(width)
        order = rank_units(delta, q)
        n = min(max_units, width)
        top = order[first_per_group(order, layer_of, n)]
        top = top[torch.sort(layer_of[top], stable=True).indices].reshape(layers, n)  # per layer, in rank order
        movers, group = moved(flat_delta, "both"), layer_of * 2 + (flat_delta > 0)
        embed = torch.zeros_like(sig)  # the preview's units: per layer and sign, the first max_units and those with q < fdr
        for pool in (movers, movers & sig):
            members = order[pool[order]]
            embed[members[first_per_group(members, group, max_units)]] = True
        ranked = order[embed[order]]
        dims[d] = {
            "cases_a": result.cases_a.get(d), "cases_b": result.cases_b.get(d),
            "mean_abs_delta": significant(delta.abs().mean(1)), "signed_mean_delta": significant(delta.mean(1)),
            "significant": sig.reshape(layers, width).sum(1).tolist(),
            **{f"significant_{way}": (sig & moved(flat_delta, way)).reshape(layers, width).sum(1).tolist()
               for way in ("up", "down")},
            "units": (top % width).tolist(), "freq_a": significant(result.freq_a[d].reshape(-1)[top]),
            "freq_b": significant(result.freq_b[d].reshape(-1)[top]), "delta": significant(flat_delta[top]),
            "q": significant(q.reshape(-1)[top]), "sig": sig[top].int().tolist(),
            "ranked": {"layer": (ranked // width).tolist(), "unit": (ranked % width).tolist(),
                       "delta": significant(flat_delta[ranked]), "q": significant(q.reshape(-1)[ranked]),
                       "sig": sig[ranked].int().tolist()},
        }
    return {"hook": result.hook, "a": result.meta.get("a", ""), "b": result.meta.get("b", ""), "fdr": fdr,
            "tested": result.tested, "layers": int(result.meta["layers"]), "width": int(result.meta["width"]),
            "max_units": max_units, "not_compared": result.empty, "dimensions": dims}


def write_explorer(diff: str | os.PathLike | DiffResult, out: str | os.PathLike, *, max_units: int = 512,
                   fdr: float = 0.05) -> Path:
    """Write the explorer page for a diff (its folder or file, or a DiffResult) to `out` (plotly.js inlined: works
    offline)."""
    from plotly.offline import get_plotlyjs

    result = diff if isinstance(diff, DiffResult) else load_diff(diff)
    if not result.dimensions:
        where = "the DiffResult" if isinstance(diff, DiffResult) else str(diff)
        raise ProbeError(f"{where}: the diff has no compared dimension (not compared: {result.empty})")
    data = json.dumps(explorer_data(result, max_units, fdr)).replace("</", "<\\/")
    page = TEMPLATE.read_text().replace("/*PLOTLYJS*/", get_plotlyjs()).replace("/*DATA*/null", data)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
