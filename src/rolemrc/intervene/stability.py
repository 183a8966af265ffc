"""How stable a selection is: the overlap of the units a selector takes from the full sample and from each Poisson
bootstrap replicate its input carries (probe/resample.py): resamples of the probe cases for the selectors that read a
diff, of the preference pairs for attribution."""

from __future__ import annotations

import os
from collections.abc import Sequence

from rolemrc.intervene.budget import CURVE, Budget
from rolemrc.intervene.select import Source, scores_of, selected_units
from rolemrc.intervene.spec import RestraintError
from rolemrc.probe.options import Direction
from rolemrc.probe.selectors import SELECTORS

STABILITY_BUDGETS = tuple(Budget("per_layer", k) for k in CURVE[:3])   # the recovery curve's, below 1,024


def selection_stability(source: Source, dimension: str, method: str, budgets: Sequence[Budget] = STABILITY_BUDGETS,
                        *, layers: str | None = None, direction: Direction = "both") -> list[dict]:
    """One row per budget: method, dimension, budget (its label), units (selected from the full sample), resamples
    (R), jaccard_mean and jaccard_min (over the R(R-1)/2 pairs of replicate selections), jaccard_full (each replicate's
    selection against the full sample's, mean) and chance (two random selections of that size from the chosen
    layers). `source`, layers and direction as `select` takes them; [] when the input holds no replicates (probed or
    attributed with resamples 0)."""
    import torch

    from rolemrc.probe.attribution import load_attribution
    from rolemrc.probe.diff import load_diff
    from rolemrc.probe.resample import selection_overlap

    if isinstance(source, str | os.PathLike):
        source = load_attribution(source) if SELECTORS.get(method).reads == "attribution" else load_diff(source)
    samples = [scores_of(method, source, dimension)]
    for replicate in source.resamples:
        try:
            samples.append(scores_of(method, replicate, dimension))
        except RestraintError:   # the replicate drew no case of the dimension
            continue
    if len(samples) == 1:
        return []
    rows = []
    for budget in budgets:
        masks = torch.zeros(len(samples), samples[0].score.numel(), dtype=torch.bool)
        for row, scores in zip(masks, samples):
            flat, allowed = selected_units(scores, method, budget, layers, direction)
            row[flat] = True
        pool = int(allowed.sum()) * samples[0].score.shape[1]
        rows.append({"method": method, "dimension": dimension, "budget": budget.label,
                     **selection_overlap(masks[0], masks[1:], pool)})
    return rows
