"""Vectorised statistics for frequency diffs: two-proportion z-tests and Benjamini-Hochberg."""

from __future__ import annotations

import math

import torch


def two_proportion_test(count_a: torch.Tensor, n_a: int, count_b: torch.Tensor, n_b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pooled two-proportion z-test per element; returns (z, two-sided p). Units never (or always)
    active in both samples have no variance: z = 0, p = 1."""
    ca, cb = count_a.double(), count_b.double()
    pooled = (ca + cb) / (n_a + n_b)
    se = torch.sqrt(pooled * (1 - pooled) * (1.0 / n_a + 1.0 / n_b))
    delta = cb / n_b - ca / n_a
    z = torch.where(se > 0, delta / se.clamp_min(1e-300), torch.zeros_like(se))
    p = torch.special.erfc(z.abs() / math.sqrt(2.0))
    return z, p.clamp(0.0, 1.0)


def benjamini_hochberg(p: torch.Tensor) -> torch.Tensor:
    """BH-adjusted q-values over all elements of `p` (any shape)."""
    flat = p.reshape(-1).double()
    m = flat.numel()
    order = torch.argsort(flat)
    ranked = flat[order] * m / torch.arange(1, m + 1, dtype=torch.float64, device=flat.device)
    ranked = torch.flip(torch.cummin(torch.flip(ranked, [0]), 0).values, [0]).clamp(max=1.0)
    q = torch.empty_like(flat)
    q[order] = ranked
    return q.reshape(p.shape)


def top_set_jaccard(freq_a: torch.Tensor, freq_b: torch.Tensor, k: int) -> torch.Tensor:
    """Per row (layer): Jaccard index of the k most frequent units under a and under b."""
    layers, width = freq_a.shape
    k = min(k, width)
    mask_a = torch.zeros(layers, width, dtype=torch.bool).scatter_(1, freq_a.topk(k, dim=1).indices, True)
    mask_b = torch.zeros(layers, width, dtype=torch.bool).scatter_(1, freq_b.topk(k, dim=1).indices, True)
    inter = (mask_a & mask_b).sum(1).double()
    union = (mask_a | mask_b).sum(1).double()
    return inter / union
