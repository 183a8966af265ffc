"""Random-unit controls for a restraint: the same number of units per layer, drawn (seeded) from the units it
does not select, at the same factor. An effect that the controls match is not an effect of *these* units."""

from __future__ import annotations

import hashlib

import torch

from rolemrc.intervene.spec import Restraint, RestraintError


def control_seed(restraint: Restraint, draw: int, seed: int) -> int:
    """A seed fixed by the restraint's units, hook and factor, the draw index and the sweep seed (stable across
    runs and machines, unlike Python's hash)."""
    key = f"{seed}:{draw}:{restraint.hook}:{restraint.factor!r}:{sorted(restraint.units.items())}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")


def draw_controls(restraint: Restraint, width: int, n: int, *, seed: int = 0) -> list[Restraint]:
    """`n` control restraints for `restraint` on a hook point `width` units wide."""
    controls = []
    for draw in range(n):
        gen = torch.Generator().manual_seed(control_seed(restraint, draw, seed))
        units = {}
        for layer, chosen in sorted(restraint.units.items()):
            free = torch.ones(width, dtype=torch.bool)
            free[chosen] = False
            pool = free.nonzero().squeeze(1)
            if len(pool) < len(chosen):
                raise RestraintError(f"layer {layer}: {len(chosen)} units selected of {width}, so too few remain "
                                     "for a random control of the same size")
            units[layer] = sorted(pool[torch.randperm(len(pool), generator=gen)[: len(chosen)]].tolist())
        controls.append(Restraint(name=f"{restraint.name}-control{draw}", hook=restraint.hook, units=units,
                                  factor=restraint.factor, source={"control_of": restraint.name, "draw": draw,
                                                                   "seed": seed}))
    return controls
