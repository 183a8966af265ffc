"""Poisson bootstrap replicates of a probe or an attribution, accumulated while counting, and the overlap of the
units selected from them.

For replicate r < R each case (a probe's prompt, an attribution's preference pair) has an integer weight
w[r, case] ~ Poisson(1), a function of (RESAMPLE_SEED, r, the case's hash `cases.case_hash`) alone: the same in any
batch order, shard or process. Every sum a probe or an attribution keeps is summed a second time per replicate with
the case's membership multiplied by its weight, so replicate r is the complete probe of a resample of the cases (case
i repeated w[r, i] times). The weights are integers, so the int64 and fixed-point sums stay exact: shards and merges
give the tensors of one pass, replicates included. In a file, `resampled.<name>` stacks replicate r's `<name>` tensor
[R, ...] for every per-dimension tensor (top cases and `case_hashes` are the full sample's only); metadata `resamples`
is R.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from rolemrc.probe.errors import ProbeError

RESAMPLED = "resampled."  # the prefix of a replicate tensor's name in a file
RESAMPLE_SEED = 0x43  # part of every weight: files with the same seed resample a shared case alike
NOT_RESAMPLED = ("case_hashes", "top_values", "top_cases")  # tensor names (before any "."): the full sample's only
_POISSON_CDF = np.cumsum([math.exp(-1) / math.factorial(k) for k in range(24)])  # P(X <= k), X ~ Poisson(1)
_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def check_resamples(resamples: int) -> int:
    if not isinstance(resamples, int) or resamples < 0:
        raise ProbeError(f"resamples must be a whole number >= 0 (0: off), got {resamples!r}")
    return resamples


def resample_weights(hashes: torch.Tensor, resamples: int) -> torch.Tensor:
    """int64 [resamples, cases]: each case's Poisson(1) weight per replicate, from its hash (int64 [cases]) alone:
    splitmix64 of (seed, r, hash) gives a uniform, the Poisson(1) quantile function turns it into the weight."""
    r = np.arange(1, resamples + 1, dtype=np.uint64)[:, None] + np.uint64(RESAMPLE_SEED << 32)
    x = hashes.cpu().numpy().astype(np.int64).view(np.uint64)[None, :] + r * _MIX[0]   # wraps mod 2^64
    x = (x ^ (x >> np.uint64(30))) * _MIX[1]
    x = (x ^ (x >> np.uint64(27))) * _MIX[2]
    x = x ^ (x >> np.uint64(31))
    uniform = (x >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    return torch.from_numpy(np.searchsorted(_POISSON_CDF, uniform, side="right").astype(np.int64))


def with_replicates(membership: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[cases, (1 + R) * dims]: the membership [cases, dims] (block 0), then per replicate r the membership times the
    cases' weights (block 1 + r; `weights` [R, cases]): a counter of (1 + R) * dims "dimensions" keeps every replicate's
    sums beside the full sample's."""
    weighted = weights.T.to(membership)[:, :, None] * membership[:, None, :]
    return torch.cat([membership, weighted.reshape(len(membership), -1)], dim=1)


def stack_replicates(replicates: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The file's `resampled.<name>` tensors [R, ...] from each replicate's tensors (names in NOT_RESAMPLED left out)."""
    if not replicates:
        return {}
    return {RESAMPLED + name: torch.stack([rep[name] for rep in replicates]).contiguous()
            for name in replicates[0] if name.split(".", 1)[0] not in NOT_RESAMPLED}


def resample_count(tensors: dict[str, torch.Tensor]) -> int:
    """R: the replicates a file's tensors hold (0 without any)."""
    return next((len(t) for name, t in tensors.items() if name.startswith(RESAMPLED)), 0)


def replicate_tensors(tensors: dict[str, torch.Tensor], r: int) -> dict[str, torch.Tensor]:
    """A file's tensors as replicate r's file: each `<name>` that has a `resampled.<name>` is its row r; the top cases
    go (they are the full sample's); the other tensors stay."""
    kept = {name: t for name, t in tensors.items()
            if not name.startswith(RESAMPLED) and name.split(".", 1)[0] not in NOT_RESAMPLED[1:]}
    return kept | {name[len(RESAMPLED):]: t[r] for name, t in tensors.items() if name.startswith(RESAMPLED)}


def selection_overlap(full: torch.Tensor, replicates: torch.Tensor, pool: int | None = None) -> dict[str, float | int]:
    """How alike the selections of the full sample (bool [units]) and of R replicates (bool [R, units]) are: the
    units selected (full sample), the Jaccard index of every pair of replicates (mean, min), of each replicate with the
    full sample (mean), each None where no pair has a unit selected (two empty selections have no overlap), and
    `chance`: about the expected Jaccard of two random selections of the same size k (the mean over the selections)
    from the same N units (`pool`, default all), k / (2N - k)."""
    masks = torch.cat([full[None], replicates]).double()
    inter = masks @ masks.T
    sizes = masks.sum(1)
    union = sizes[:, None] + sizes[None, :] - inter
    jaccard = inter / union   # NaN where both selections are empty: undefined, left out of the means
    n_rep, total = len(replicates), full.numel() if pool is None else pool
    pairs = jaccard[1:, 1:][torch.triu_indices(n_rep, n_rep, 1).unbind()]
    pairs, with_full = pairs[~pairs.isnan()], jaccard[0, 1:][~jaccard[0, 1:].isnan()]
    k = float(sizes.mean())
    return {"units": int(sizes[0]), "resamples": n_rep,
            "jaccard_mean": float(pairs.mean()) if len(pairs) else None,
            "jaccard_min": float(pairs.min()) if len(pairs) else None,
            "jaccard_full": float(with_full.mean()) if len(with_full) else None,
            "chance": k / (2 * total - k) if total else 0.0}


def stability_lines(rows: list[dict]) -> list[str]:
    """`selection_overlap` rows (with dimension, method and budget) as an aligned text table."""
    def number(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    head = f"{'dimension':<22} {'method':<14} {'budget':<10} {'units':>7} {'jaccard mean':>12} {'min':>6} " \
           f"{'vs full':>7} {'chance':>6}"
    return [head] + [f"{r['dimension']:<22} {r['method']:<14} {r['budget']:<10} {r['units']:>7} "
                     f"{number(r['jaccard_mean']):>12} {number(r['jaccard_min']):>6} {number(r['jaccard_full']):>7} "
                     f"{number(r['chance']):>6}" for r in rows]
