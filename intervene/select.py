"""Turning a probe diff into a restraint: the most changed units of one dimension."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rolemrc.intervene.spec import Restraint, RestraintError, parse_layers
from rolemrc.probe.diff import DIFF_FILE, load_diff
from rolemrc.probe.options import DIRECTIONS, Direction
from rolemrc.probe.ranking import moved, rank_units


def select(diff_path: str | os.PathLike, dimension: str, *, layers: str | None = None, top_k: int | None = None,
           fdr: float | None = None, direction: Direction = "both", factor: float = 1 - 1e-6,
           name: str | None = None) -> Restraint:
    """Units of `dimension` whose frequency moved most between A and B, in `probe.ranking.rank_units` order.

    top_k: the first k over the chosen layers; fdr: every unit with BH q < fdr.
    direction: both (delta != 0), up (delta > 0) or down (delta < 0).
    """
    if (top_k is None) == (fdr is None):
        raise RestraintError("choose exactly one of top_k or fdr")
    if top_k is not None and top_k < 1:
        raise RestraintError(f"top_k must be >= 1, got {top_k}")
    if direction not in DIRECTIONS:
        raise RestraintError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    result = load_diff(diff_path)
    if dimension not in result.delta:
        why = result.empty.get(dimension)
        raise RestraintError(f"dimension {dimension!r} is not in the diff" + (f" ({why})" if why else "")
                             + f"; compared: {result.dimensions}")
    if fdr is not None and not result.tested:
        raise RestraintError(f"{diff_path}: the diff has no q-values (test: {result.test}); select with top_k")
    delta, q = result.delta[dimension], result.qvalue[dimension].double()
    n_layers, n_units = delta.shape
    chosen = parse_layers(layers, n_layers)
    allowed = torch.zeros(n_layers, dtype=torch.bool)
    allowed[chosen if chosen is not None else slice(None)] = True

    eligible = allowed[:, None] & moved(delta, direction)
    if fdr is not None:
        eligible &= q < fdr
    order = rank_units(delta, q)
    flat = order[eligible.reshape(-1)[order]][:top_k]
    if len(flat) == 0:
        raise RestraintError(f"no unit of {dimension!r} qualifies (layers {layers or 'all'}, direction {direction}"
                             + (f", q < {fdr}" if fdr is not None else "") + ")")
    units: dict[int, list[int]] = {}
    for layer, unit in zip((flat // n_units).tolist(), (flat % n_units).tolist()):
        units.setdefault(layer, []).append(unit)
    diff_file = Path(diff_path) / DIFF_FILE if Path(diff_path).is_dir() else Path(diff_path)
    source = {"diff": str(diff_file), "dimension": dimension, "direction": direction,
              "layers": layers or "all", **({"top_k": top_k} if top_k is not None else {"fdr": fdr})}
    return Restraint(name=name or f"{dimension.replace('_', '-')}-restraint", hook=result.hook, units=units,
                     factor=factor, source=source)
