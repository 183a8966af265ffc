"""Restraints as runtime forward hooks on the probe's hook sites."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
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


@dataclass(frozen=True)
class RowScales:
    """Per-row multipliers of a batch: (hook, layer) -> [rows, width], row i carrying `restraints[i]` (None: all
    ones). Sites no row restrains are absent, so a batch without restraints runs without hooks. Rows come and go
    with the batch they describe (`select`, `merge`), so continuous batching keeps each row's restraint."""

    restraints: tuple[Restraint | None, ...]
    scales: dict[tuple[str, int], torch.Tensor]

    @classmethod
    def of(cls, model: Any, rows: Sequence[Restraint | None], checked: bool = False) -> RowScales:
        """Scales for `rows`; `checked`: the restraints were validated against `model` already."""
        param = next(model.parameters())
        scales: dict[tuple[str, int], torch.Tensor] = {}
        for r in {id(r): r for r in rows if r is not None}.values():   # one indexed write per restraint and layer
            if not checked:
                validate(r, model)
            index = torch.tensor([i for i, x in enumerate(rows) if x is r], device=param.device)[:, None]
            factor = torch.tensor(r.factor, dtype=param.dtype)
            for layer, units in r.units.items():
                key = (r.hook, layer)
                if key not in scales:
                    scales[key] = torch.ones(len(rows), width(model, r.hook), dtype=param.dtype, device=param.device)
                scales[key][index, torch.tensor(units, device=param.device)] *= factor
        return cls(tuple(rows), scales)

    def __len__(self) -> int:
        return len(self.restraints)

    def select(self, rows: Sequence[int]) -> RowScales:
        """Only `rows`, in that order (sites no kept row restrains are dropped)."""
        kept = tuple(self.restraints[i] for i in rows)
        used = {(r.hook, layer) for r in {id(r): r for r in kept if r is not None}.values() for layer in r.units}
        index = torch.tensor(list(rows), dtype=torch.long)
        return RowScales(kept, {k: s[index.to(s.device)] for k, s in self.scales.items() if k in used})

    def merge(self, other: RowScales) -> RowScales:
        """These rows, then `other`'s (a site only one side restrains is all ones on the other)."""
        def part(side: RowScales, like: torch.Tensor, key: tuple[str, int]) -> torch.Tensor:
            return side.scales[key] if key in side.scales else like.new_ones(len(side), like.shape[1])

        scales = {}
        for key in self.scales.keys() | other.scales.keys():
            like = self.scales.get(key, other.scales.get(key))
            scales[key] = torch.cat([part(self, like, key), part(other, like, key)])
        return RowScales(self.restraints + other.restraints, scales)


@contextmanager
def applied_rows(model: Any, scales: RowScales) -> Iterator[Any]:
    """Multiply each row's tensor at every restrained site by its row of `scales` for the duration of the block
    (the same multiply `applied` does, per row). Inside, every batch must have len(scales) rows."""
    handles = []
    try:
        for (hook, layer), scale in scales.scales.items():
            handles.append(site(model, hook, layer).rewrite(lambda t, s=scale: t * s.to(t.dtype)[:, None, :]))
        yield model
    finally:
        for h in handles:
            h.remove()
