"""Restraints as runtime forward hooks on the probe's hook sites."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from rolemrc.intervene.fit import validate
from rolemrc.intervene.spec import Restraint
from rolemrc.probe.hooks import site, width


def scale_vector(r: Restraint, layer: int, n_units: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[width] multipliers: `factor` at the restrained units, exactly 1 elsewhere (so x * 1 == x)."""
    scale = torch.ones(n_units, dtype=dtype, device=device)
    scale[r.units[layer]] = torch.tensor(r.factor, dtype=dtype)
    return scale


@contextmanager
def applied(model: Any, *restraints: Restraint, checked: bool = False) -> Iterator[Any]:
    """Apply restraints as forward hooks for the duration of the block; several compose
    (multiplicatively, in the order given). On exit the hooks are removed and the model is untouched.
    `checked`: the restraints were validated against `model` already (a server does so once per request)."""
    if not checked:
        for r in restraints:
            validate(r, model)
    param = next(model.parameters())
    handles = []
    try:
        for r in restraints:
            n_units = width(model, r.hook)
            for layer in r.units:
                scale = scale_vector(r, layer, n_units, param.dtype, param.device)
                handles.append(site(model, r.hook, layer).rewrite(lambda t, s=scale: t * s.to(t.dtype)))
        yield model
    finally:
        for h in handles:
            h.remove()


@contextmanager
def applied_per_row(model: Any, rows: list[Restraint | None]) -> Iterator[Any]:
    """Apply a different restraint to each row of the batch (None: none) for the duration of the block, so one
    batched forward or `generate` serves many restraints. Inside, every batch must have len(rows) rows."""
    param = next(model.parameters())
    scales: dict[tuple[str, int], torch.Tensor] = {}   # (hook, layer) -> [rows, width]; sites no row restrains absent
    for r in {id(r): r for r in rows if r is not None}.values():   # one indexed write per restraint and layer
        validate(r, model)
        index = torch.tensor([i for i, x in enumerate(rows) if x is r], device=param.device)[:, None]
        factor = torch.tensor(r.factor, dtype=param.dtype)
        for layer, units in r.units.items():
            key = (r.hook, layer)
            if key not in scales:
                scales[key] = torch.ones(len(rows), width(model, r.hook), dtype=param.dtype, device=param.device)
            scales[key][index, torch.tensor(units, device=param.device)] *= factor
    handles = []
    try:
        for (hook, layer), scale in scales.items():
            handles.append(site(model, hook, layer).rewrite(lambda t, s=scale: t * s.to(t.dtype)[:, None, :]))
        yield model
    finally:
        for h in handles:
            h.remove()
