"""`rolemrc probe explore DIFF_DIR --out explorer.html`: one self-contained interactive Plotly page.

Pick a dimension; see the layer-by-layer shift; click a layer to see its units (frequency under A vs B,
delta, FDR-significant units highlighted); preview which units a restraint with given layers / top-k /
direction would select. Per layer the page embeds the `max_units` most changed units, so the preview is
exact for top-k <= max_units.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from rolemrc.probe.diff import DiffResult, load_diff
from rolemrc.probe.errors import ProbeError

TEMPLATE = Path(__file__).with_name("templates") / "explorer.html"
DECIMALS = 5   # per-unit values in the page: frequencies are hits / cases, q is compared with fdr >= 1e-4


def explorer_data(result: DiffResult, max_units: int = 512, fdr: float = 0.05) -> dict:
    """The JSON the page runs on: per dimension, per-layer summaries and each layer's top units."""
    dims = {}
    for d in result.dimensions:
        delta, q = result.delta[d], result.qvalue[d]
        n = min(max_units, delta.shape[1])
        top = delta.abs().topk(n, dim=1).indices  # [layers, n]
        gather = lambda t, top=top: torch.gather(t.double(), 1, top).round(decimals=DECIMALS).tolist()  # noqa: E731
        dims[d] = {
            "cases_a": result.cases_a.get(d), "cases_b": result.cases_b.get(d),
            "mean_abs_delta": delta.abs().mean(1).double().round(decimals=7).tolist(),
            "signed_mean_delta": delta.mean(1).double().round(decimals=7).tolist(),
            "significant": (q < fdr).sum(1).tolist(),
            "units": top.tolist(), "freq_a": gather(result.freq_a[d]), "freq_b": gather(result.freq_b[d]),
            "delta": gather(delta), "q": gather(q),
        }
    return {"hook": result.hook, "a": result.meta.get("a", ""), "b": result.meta.get("b", ""), "fdr": fdr,
            "layers": int(result.meta["layers"]), "width": int(result.meta["width"]), "max_units": max_units,
            "not_compared": result.empty, "dimensions": dims}


def write_explorer(diff_dir: str | os.PathLike, out: str | os.PathLike, *, max_units: int = 512,
                   fdr: float = 0.05) -> Path:
    """Write the explorer page for the diff in `diff_dir` (plotly.js inlined: works offline)."""
    from plotly.offline import get_plotlyjs

    result = load_diff(diff_dir)
    if not result.dimensions:
        raise ProbeError(f"{diff_dir}: the diff has no compared dimension (not compared: {result.empty})")
    data = json.dumps(explorer_data(result, max_units, fdr)).replace("</", "<\\/")
    page = TEMPLATE.read_text().replace("/*PLOTLYJS*/", get_plotlyjs()).replace("/*DATA*/null", data)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
