"""Vectorised statistics for frequency diffs (over all units at once, no loop over units): the unpaired
two-proportion z-test, the exact McNemar test and the paired t-test for paired probe files, Benjamini-Hochberg."""

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


def mcnemar_exact(b01: torch.Tensor, b10: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact McNemar test per element: b01 = cases active under A only, b10 = under B only; two-sided
    binomial test of b10 among b01 + b10 discordant cases at 1/2 (= scipy.stats.binomtest). Returns the
    signed statistic (b10 - b01) / sqrt(b01 + b10) (0 without discordant cases) and p."""
    from scipy.stats import binom

    lo, n = torch.minimum(b01, b10).double(), (b01 + b10).double()
    p = torch.from_numpy(binom.cdf(lo.cpu().numpy(), n.cpu().numpy(), 0.5) * 2).clamp(max=1.0)
    stat = torch.where(n > 0, (b10 - b01).double() / n.clamp_min(1).sqrt(), torch.zeros_like(n))
    return stat.cpu(), p


def paired_t_test(total: torch.Tensor, squares: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Paired t-test per element from streamed sums over n cases of d and d^2 (= scipy.stats.ttest_rel).
    Returns (t, two-sided p). No variance: t = 0, p = 1 where the mean is 0 (or n < 2), else t = +-inf, p = 0."""
    from scipy.stats import t as student

    total, squares = total.double().cpu(), squares.double().cpu()
    if n < 2:
        return torch.zeros_like(total), torch.ones_like(total)
    mean = total / n
    var = ((squares - total * mean) / (n - 1)).clamp_min(0)
    flat = var <= 1e-12 * squares / n  # numerically constant d
    t = torch.where(flat, torch.sign(mean) * torch.inf, mean / (var / n).sqrt())
    t = torch.where(mean == 0, torch.zeros_like(t), t)
    p = torch.from_numpy(2 * student.sf(t.abs().numpy(), n - 1))
    return t, p.clamp(0.0, 1.0)


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
