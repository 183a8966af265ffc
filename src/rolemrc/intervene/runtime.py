"""Restraints as runtime forward hooks on the probe's hook sites."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from rolemrc.core.hooks import site, width
from rolemrc.intervene.fit import validate
from rolemrc.intervene.spec import Restraint


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
