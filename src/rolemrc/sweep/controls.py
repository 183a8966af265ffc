"""Random-unit controls for a restraint: per layer as many units as it selects there, drawn (seeded) from the units it
does not select, at the same factor, and matched on activation magnitude: each selected unit's stand-in comes from
the same decile of its layer's units ranked by mean |activation|. An effect that the controls match is not an effect
of *these* units, nor of units that active. A direction's controls are random unit directions in its layers."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

from rolemrc.intervene.spec import Restraint, RestraintError

BINS = 10   # controls are matched on deciles of each layer's unit magnitudes
UNIFORM = "uniform"
RANDOM_DIRECTIONS = "random unit directions in the cell's layers"   # a direction's controls: nothing to match on


def control_seed(restraint: Restraint, draw: int, seed: int) -> int:
    """A seed fixed by the restraint's units, hook and factor, the draw index and the sweep seed (stable across
    runs and machines, unlike Python's hash)."""
    key = f"{seed}:{draw}:{restraint.hook}:{restraint.factor!r}:{sorted(restraint.units.items())}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")


def unit_magnitudes(source: str | os.PathLike, dimension: str) -> tuple[torch.Tensor | None, str]:
    """(float64 [layers, width] |mean activation| of each unit on `dimension`'s cases under a diff's B side, the model
    a restraint scales, from the diff's activation moments; what they are) or, when `source` (a selector's input)
    has none, (None, why)."""
    from safetensors import safe_open

    from rolemrc.core.artifacts import expect
    from rolemrc.intervene.inputs import input_file

    expect(source, ("diff", "diff-file", "attribution"), "controls are matched on a diff's activation moments")
    file = input_file(source)
    with safe_open(str(file), "pt") as f:
        kind, name, names = (f.metadata() or {}).get("kind"), f"mean_b.{dimension}", f.keys()
        mean = f.get_tensor(name) if kind == "diff" and name in names else None
    if mean is None or not bool(mean.any()):
        return None, f"{UNIFORM}: {file} ({kind}) holds no activation moments of {dimension}"
    return mean.double().abs(), f"{dimension}'s mean |activation| under the B side of {file} (mean_b)"


def buckets(magnitude: torch.Tensor, bins: int) -> torch.Tensor:
    """int64 [layers, width]: each unit's bin (0 .. bins - 1) by its magnitude's rank within its layer."""
    width = magnitude.shape[1]
    return magnitude.argsort(dim=1, stable=True).argsort(dim=1) * bins // width


def matched_draw(chosen: torch.Tensor, bucket: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """(bool [layers, width] control units, how many were not matched): for each chosen unit a random unchosen one of
    its layer and bucket, without repeats. A bucket with fewer unchosen units than chosen ones gives what it has
    and the rest come uniformly from the layer's other unchosen units (counted as not matched)."""
    layers, width = chosen.shape
    free = ~chosen
    if bool((free.sum(1) < chosen.sum(1)).any()):
        layer = int((free.sum(1) < chosen.sum(1)).nonzero()[0])
        raise RestraintError(f"layer {layer}: {int(chosen[layer].sum())} units selected of {width}, so too few remain "
                             "for a random control of the same size")
    bins = int(bucket.max()) + 1
    need = torch.zeros(layers, bins, dtype=torch.long).scatter_add_(1, bucket, chosen.long())
    have = torch.zeros(layers, bins, dtype=torch.long).scatter_add_(1, bucket, free.long())
    key = (bucket + torch.rand(layers, width, generator=gen, dtype=torch.float64)).masked_fill(chosen, torch.inf)
    order = key.argsort(1)   # unchosen units grouped by bucket, in random order within it; the chosen last
    sorted_bucket = bucket.gather(1, order)
    position = torch.arange(width) - (have.cumsum(1) - have).gather(1, sorted_bucket)   # rank within its bucket
    take = (position < need.gather(1, sorted_bucket)) & free.gather(1, order)
    picked = torch.zeros_like(chosen).scatter_(1, order, take)
    short = chosen.sum(1) - picked.sum(1)
    rest = torch.rand(layers, width, generator=gen, dtype=torch.float64).masked_fill(chosen | picked, torch.inf)
    extra = torch.zeros_like(chosen).scatter_(1, rest.argsort(1), torch.arange(width) < short[:, None])
    return picked | extra, int(short.sum())


def draw_controls(restraint: Restraint, width: int, n: int, *, seed: int = 0, magnitude: torch.Tensor | None = None,
                  how: str = UNIFORM) -> list[Restraint]:
    """`n` control restraints for `restraint` on a hook point `width` units wide, matched on the deciles of
    `magnitude` ([layers, width], `unit_magnitudes`; `how` says what it is) or, without it, uniform per layer."""
    layers = max(restraint.units) + 1 if magnitude is None else magnitude.shape[0]
    if magnitude is not None and (tuple(magnitude.shape[1:]) != (width,) or layers <= max(restraint.units)):
        raise RestraintError(f"unit magnitudes of shape {tuple(magnitude.shape)} do not fit a restraint on layers "
                             f"{sorted(restraint.units)} of {width} units")
    bins = 1 if magnitude is None else BINS
    bucket = torch.zeros(layers, width, dtype=torch.long) if magnitude is None else buckets(magnitude, bins)
    chosen = torch.zeros(layers, width, dtype=torch.bool)
    for layer, units in restraint.units.items():
        chosen[layer, units] = True
    controls = []
    for draw in range(n):
        picked, unmatched = matched_draw(chosen, bucket, torch.Generator().manual_seed(control_seed(restraint, draw, seed)))
        units = {layer: picked[layer].nonzero().squeeze(1).tolist() for layer in sorted(restraint.units)}
        controls.append(Restraint(name=f"{restraint.name}-control{draw}", hook=restraint.hook, units=units,
                                  factor=restraint.factor, source={"control_of": restraint.name, "draw": draw,
                                                                   "seed": seed, "bins": bins, "matched_on": how,
                                                                   "unmatched": unmatched}))
    return controls


def random_directions(restraint: Restraint, n: int, seed: int = 0) -> list[Restraint]:
    """`n` controls for a direction restraint: per layer of it a random unit direction (uniform on the sphere), drawn
    from a generator seeded by the sweep seed and the restraint's digest."""
    key = hashlib.sha256(f"{seed}:{restraint.digest}".encode()).digest()[:8]
    gen = torch.Generator().manual_seed(int.from_bytes(key, "little"))
    width = len(next(iter(restraint.directions.values())))
    return [Restraint(name=f"{restraint.name}-control{draw}", hook=restraint.hook, kind="direction",
                      directions={layer: torch.randn(width, generator=gen, dtype=torch.float64).tolist()
                                  for layer in restraint.sites},
                      source={"control_of": restraint.name, "draw": draw, "seed": seed, "matched_on": RANDOM_DIRECTIONS,
                              "unmatched": 0})
            for draw in range(n)]


def controls_record(cells: list[Any]) -> dict[str, Any]:
    """plan.json's account of the controls: how many per cell, and per dimension how they were matched."""
    controls = [c for c in cells if c.kind == "control"]
    selected = sum(c.kind == "selected" for c in cells)
    directions = any(c.restraint.kind == "direction" for c in controls)
    return {"per_cell": len(controls) // selected if selected else 0, "bins": BINS,
            "matched_on": {c.grid["dimension"]: c.restraint.source["matched_on"] for c in controls},
            "unmatched_units": sum(c.restraint.source["unmatched"] for c in controls),
            "how": "per layer of a direction cell a random unit direction (uniform on the sphere)" if directions else
                   "per layer as many units as the cell; each from its unit's decile of mean |activation| in that "
                   "layer, the cell's own units excluded (a short decile: the rest uniform, counted in "
                   "unmatched_units); uniform per layer where no magnitudes are known"}
