"""Restraints as runtime forward hooks on the probe's hook sites: every hooked kind (scale, patch, direction) is one
rewrite of a site's tensor, `t * scale + shift`, then the direction projected out (`SiteRows`). A revert is baked."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from rolemrc.core.hooks import site, width
from rolemrc.intervene.fit import validate
from rolemrc.intervene.spec import Restraint, RestraintError

OPS = ("scale", "shift", "direction")   # a site's rewrite, in this order; each present only where some kind needs it


@dataclass(frozen=True)
class SiteRows:
    """One restraint's rewrite of one site's [..., width] tensor: scale, shift and direction (None: not used)."""

    scale: torch.Tensor | None = None       # multipliers: 1 where untouched, so t * 1 == t exactly
    shift: torch.Tensor | None = None       # added after scaling: 0 where untouched
    direction: torch.Tensor | None = None   # unit vector projected out last

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        return rewrite(t, self.scale, self.shift, self.direction)


def rewrite(t: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None,
            direction: torch.Tensor | None) -> torch.Tensor:
    """`t * scale + shift`, then `direction` projected out: t - (t . d) d. Each operand broadcasts over t's leading
    dimensions and is cast to t's dtype; a zero direction and a zero shift change nothing."""
    if scale is not None and shift is not None:
        t = torch.addcmul(shift.to(t.dtype), t, scale.to(t.dtype))   # one pass over t
    elif scale is not None:
        t = t * scale.to(t.dtype)
    elif shift is not None:
        t = t + shift.to(t.dtype)
    if direction is not None:
        d = direction.to(t.dtype)
        t = torch.addcmul(t, torch.matmul(t, d.unsqueeze(-1) if d.dim() == 1 else d.transpose(-1, -2)), d, value=-1)
    return t


def refuse_unhooked(r: Restraint) -> Restraint:
    """`r` if it applies as a runtime hook, else a RestraintError (a revert is baked)."""
    if not r.hooked:
        raise RestraintError(f"restraint {r.name!r} is a {r.kind}: it is baked into weights (`rolemrc intervene bake`), "
                             "not applied as a runtime hook")
    return r


def site_rows(r: Restraint, layer: int, n_units: int, dtype: torch.dtype, device: torch.device) -> SiteRows:
    """The rows that apply hooked restraint `r` at `layer`."""
    refuse_unhooked(r)
    if r.kind == "direction":
        return SiteRows(direction=torch.tensor(r.directions[layer], dtype=torch.float64).to(dtype=dtype, device=device))
    scale = torch.ones(n_units, dtype=dtype, device=device)
    units = torch.tensor(r.units[layer], device=device)
    scale[units] = torch.tensor(r.factor if r.kind == "scale" else 0.0, dtype=dtype, device=device)
    if r.kind == "scale":
        return SiteRows(scale=scale)
    shift = torch.zeros(n_units, dtype=dtype, device=device)
    shift[units] = torch.tensor(r.values[layer], dtype=torch.float64).to(dtype=dtype, device=device)
    return SiteRows(scale=scale, shift=shift)


@contextmanager
def applied(model: Any, *restraints: Restraint, checked: bool = False) -> Iterator[Any]:
    """Apply hooked restraints (scale, patch, direction) as forward hooks for the duration of the block; several
    compose in the order given. On exit the hooks are removed and the model is untouched. `checked`: the restraints
    were validated against `model` already (a server does so once per request)."""
    for r in restraints:
        refuse_unhooked(r)
        if not checked:
            validate(r, model)
    param = next(model.parameters())
    rows = [(r, layer, site_rows(r, layer, width(model, r.hook), param.dtype, param.device))
            for r in restraints for layer in r.sites]   # every restraint checked before any hook goes in
    handles = []
    try:
        for r, layer, row in rows:
            handles.append(site(model, r.hook, layer).rewrite(row.apply))
        yield model
    finally:
        for h in handles:
            h.remove()
