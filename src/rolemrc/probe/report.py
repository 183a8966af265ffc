"""Writing a diff to a directory: tensors, tables, summary and heatmaps."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rolemrc.probe.diff import DiffResult
from rolemrc.probe.plots import write_heatmaps


def write_diff(result: DiffResult, out_dir: str | os.PathLike, *, top_n: int = 200, fdr: float = 0.05,
               bins: int = 64, figures: bool = True) -> dict:
    """Save the diff (see DiffResult.save) plus heatmaps; returns the summary with figure paths."""
    out = result.save(out_dir, top_n=top_n, fdr=fdr)
    summary = json.loads((out / "summary.json").read_text())
    if figures:
        summary["figures"] = write_heatmaps(result, out, bins=bins)
        (Path(out) / "summary.json").write_text(json.dumps(summary, indent=1))
    summary["out"] = str(out)
    return summary
