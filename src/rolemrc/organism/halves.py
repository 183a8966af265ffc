"""Choose on one half, report on the other: a seed's held-out cases split into a selection half (the recommendation
chooses its recipe there) and a confirmation half (everything reported about the recipe is measured there), so the
numbers a user reads are not the ones the recipe won on (the winner's curse).

The split is stratified: the cases of each set of dimensions (`core.taxonomy.dimensions_for_task`) are shuffled with
the seed and dealt alternately, so both halves hold cases of every dimension (an odd stratum's extra case goes to the
confirmation half, where the verdict is read). The neutral texts are dealt the same way."""

from __future__ import annotations

import random
from pathlib import Path

from rolemrc.core.io import read_jsonl
from rolemrc.core.taxonomy import dimensions_for_task
from rolemrc.sweep.kl import NEUTRAL_ID

HALVES = ("selection", "confirmation")
Halves = dict[str, set[str]]   # half -> the item ids in it (held-out case ids and neutral text ids)


def deal(strata: dict[tuple, list[str]], seed: int) -> Halves:
    """Each stratum's ids shuffled with `seed` and dealt alternately, confirmation first."""
    rng = random.Random(f"halves-{seed}")
    out: Halves = {half: set() for half in HALVES}
    for key in sorted(strata):
        ids = sorted(strata[key])
        rng.shuffle(ids)
        for k, item in enumerate(ids):
            out[HALVES[(k + 1) % 2]].add(item)
    return out


def case_halves(heldout: str | Path, neutral: str | Path | None, seed: int) -> Halves:
    """The selection and confirmation halves of an organism's held-out cases and (`neutral`: its neutral texts, one per
    line, ids `neutral-<line>`) neutral texts."""
    strata: dict[tuple, list[str]] = {}
    for row in read_jsonl(heldout):
        strata.setdefault(tuple(dimensions_for_task(row.get("task"))), []).append(row["id"])
    if neutral:
        lines = [line for line in Path(neutral).read_text(encoding="utf-8").splitlines() if line.strip()]
        strata[("neutral",)] = [f"{NEUTRAL_ID}{j}" for j in range(len(lines))]
    return deal(strata, seed)
