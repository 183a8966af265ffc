"""Turning a selector's scores into a restraint: the most changed units of one dimension (intervene/selectors.py)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rolemrc.intervene.selectors import SELECTORS, Source
from rolemrc.intervene.spec import Restraint, RestraintError, parse_layers
from rolemrc.probe.options import DIRECTIONS, Direction
from rolemrc.probe.ranking import moved, rank_units


def select(source: Source, dimension: str, *, method: str = "frequency", layers: str | None = None,
           top_k: int | None = None, fdr: float | None = None, direction: Direction = "both",
           factor: float = 1 - 1e-6, name: str | None = None) -> Restraint:
    """Units of `dimension` that `method` (a name in SELECTORS; default the paper's frequency delta) scores highest,
    in `probe.ranking.rank_units` order (|score| descending, q ascending, layer, unit).

    source: the selector's input: a diff directory or file, or a `DiffResult` (an attribution file or an
    `Attribution` for `attribution`); a spec selected from an object records its source as "in memory".
    top_k: the first k over the chosen layers; fdr: every unit with BH q < fdr (selectors with a test only).
    direction: both (score != 0), up (score > 0: more under B) or down (score < 0).
    """
    entry = SELECTORS.get(method)
    if (top_k is None) == (fdr is None):
        raise RestraintError("choose exactly one of top_k or fdr")
    if top_k is not None and top_k < 1:
        raise RestraintError(f"top_k must be >= 1, got {top_k}")
    if direction not in DIRECTIONS:
        raise RestraintError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    scores = entry.scores(Path(source) if isinstance(source, str | os.PathLike) else source, dimension)
    if fdr is not None and scores.q is None:
        raise RestraintError(f"{scores.origin}: --method {method} has no q-values here ({scores.no_q}); select with top_k")
    score = scores.score.double()
    q = scores.q.double() if scores.q is not None else torch.full_like(score, torch.nan)
    n_layers, n_units = score.shape
    chosen = parse_layers(layers, n_layers)
    allowed = torch.zeros(n_layers, dtype=torch.bool)
    allowed[chosen if chosen is not None else slice(None)] = True

    eligible = allowed[:, None] & moved(score, direction)
    if fdr is not None:
        eligible &= q < fdr
    order = rank_units(score, q)
    flat = order[eligible.reshape(-1)[order]][:top_k]
    if len(flat) == 0:
        raise RestraintError(f"no unit of {dimension!r} qualifies (method {method}, layers {layers or 'all'}, direction "
                             f"{direction}" + (f", q < {fdr}" if fdr is not None else "") + ")")
    units: dict[int, list[int]] = {}
    for layer, unit in zip((flat // n_units).tolist(), (flat % n_units).tolist()):
        units.setdefault(layer, []).append(unit)
    spec_source = {entry.reads: scores.origin, "method": method, "dimension": dimension,
                   "direction": direction, "layers": layers or "all",
                   **({"top_k": top_k} if top_k is not None else {"fdr": fdr})}
    model = scores.model and {**scores.model, "layers": n_layers, "width": n_units}
    return Restraint(name=name or f"{dimension.replace('_', '-')}-restraint", hook=scores.hook, units=units,
                     factor=factor, source=spec_source, model=model)
