"""The one ranking of a diff's most changed units, used by `probe diff` (units.csv/json), `intervene select` and the
explorer page (which embeds this order, so its preview selects exactly what `select` does)."""

from __future__ import annotations

import torch

from rolemrc.probe.options import Direction


def rank_units(delta: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """Flat indices (layer * width + unit) of every unit of a [layers, width] diff, most changed first: |delta|
    descending, then q ascending (a NaN q ranks after every q; None: no test), then layer, then unit.

    Stable sorts from the last key to the first: the flat index already orders layer, then unit."""
    abs_delta = delta.detach().reshape(-1).double().abs().cpu()
    if q is None:
        order = torch.arange(abs_delta.numel())
    else:
        order = torch.sort(q.detach().reshape(-1).double().cpu().nan_to_num(torch.inf), stable=True).indices
    return order[torch.sort(abs_delta[order], descending=True, stable=True).indices]


def moved(delta: torch.Tensor, direction: Direction) -> torch.Tensor:
    """Bool mask of the units that moved in `direction`: both (delta != 0), up (delta > 0) or down (delta < 0)."""
    return {"both": delta != 0, "up": delta > 0, "down": delta < 0}[direction]


def first_per_group(order: torch.Tensor, group: torch.Tensor, n: int) -> torch.Tensor:
    """Bool mask over `order`: True for the first `n` entries of each group, `group` giving a group id per flat index."""
    ids = group.reshape(-1)[order]
    sorted_ids, by_group = torch.sort(ids, stable=True)  # within a group, entries keep their place in `order`
    starts = torch.searchsorted(sorted_ids, sorted_ids)  # where each entry's group begins
    within = torch.empty_like(by_group)
    within[by_group] = torch.arange(len(ids)) - starts
    return within < n
