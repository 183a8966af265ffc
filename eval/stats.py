"""Bootstrap confidence intervals (plain or stratified), exact McNemar, and the paired comparison of two runs:
a bootstrap CI with a sign-flip permutation p-value (numpy/scipy, vectorised)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

EXACT_MAX_N = 16        # sign-flip test: enumerate all 2^n flips up to this many nonzero differences
REL_TOL = 1e-12         # a flipped statistic within this relative distance of the observed one counts as a tie


def resample_counts(n: int, rounds: int, seed: int, strata: np.ndarray | None = None) -> np.ndarray:
    """[rounds, n] multiplicity of each item in `rounds` bootstrap resamples of n items. With `strata`
    (a label per item), items are drawn with replacement within each stratum, so every resample keeps
    each stratum's size (a stratified bootstrap)."""
    rng = np.random.default_rng(seed)
    if strata is None:
        return rng.multinomial(n, np.full(n, 1.0 / n), size=rounds).astype(np.float64)
    _, code, size = np.unique(np.asarray(strata), return_inverse=True, return_counts=True)
    order = np.argsort(code, kind="stable")                  # items grouped by stratum
    start = np.concatenate([[0], np.cumsum(size)[:-1]])[code[order]]
    picks = order[start + (rng.random((rounds, n)) * size[code[order]]).astype(np.int64)]
    flat = (np.arange(rounds)[:, None] * n + picks).ravel()
    return np.bincount(flat, minlength=rounds * n).reshape(rounds, n).astype(np.float64)


def percentile_cis(samples: np.ndarray, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Column-wise percentile intervals of bootstrap samples [rounds, k], ignoring resamples where the
    statistic is undefined (NaN or infinite); NaN for a column with no finite sample."""
    samples = np.where(np.isfinite(samples), samples, np.nan)
    empty = np.isnan(samples).all(0)
    with np.errstate(invalid="ignore"):
        lo, hi = np.nanquantile(np.where(empty, 0.0, samples), [(1 - level) / 2, (1 + level) / 2], axis=0)
    return np.where(empty, np.nan, lo), np.where(empty, np.nan, hi)


def percentile_ci(samples: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of one statistic's bootstrap samples [rounds]."""
    lo, hi = percentile_cis(np.asarray(samples, dtype=np.float64).reshape(-1, 1), level)
    return float(lo[0]), float(hi[0])


def bootstrap(stat: Callable[[np.ndarray], np.ndarray], n: int, *, rounds: int = 2000, seed: int = 0,
              level: float = 0.95) -> tuple[float, float]:
    """CI of a statistic of n items. `stat` maps item weights [rounds, n] to values [rounds];
    with all-ones weights it must give the point estimate."""
    if n == 0:
        return math.nan, math.nan
    with np.errstate(invalid="ignore", divide="ignore"):
        return percentile_ci(stat(resample_counts(n, rounds, seed)), level)


def mean_ci(values, *, rounds: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """{mean, std, lo, hi, n} of per-item values with a bootstrap CI."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return {"mean": math.nan, "std": math.nan, "lo": math.nan, "hi": math.nan, "n": 0}
    lo, hi = bootstrap(lambda w: w @ x / x.size, x.size, rounds=rounds, seed=seed, level=level)
    return {"mean": float(x.mean()), "std": float(x.std(ddof=1)) if x.size > 1 else 0.0, "lo": lo, "hi": hi,
            "n": int(x.size)}


def mcnemar_exact(a: list[int], b: list[int]) -> dict:
    """Exact (binomial) McNemar test on paired binary outcomes a -> b, with effect sizes.

    b01: a=0, b=1 (improved); b10: a=1, b=0 (worsened). p is two-sided. The odds ratio b01/b10 uses
    the Haldane 0.5 correction when a cell is 0.
    """
    from scipy.stats import binomtest

    x, y = np.asarray(a, dtype=int), np.asarray(b, dtype=int)
    if x.shape != y.shape:
        raise ValueError("McNemar needs paired outcomes of equal length")
    b01, b10 = int(((x == 0) & (y == 1)).sum()), int(((x == 1) & (y == 0)).sum())
    n = b01 + b10
    p = binomtest(b01, n, 0.5).pvalue if n else 1.0
    ratio = (b01 + 0.5) / (b10 + 0.5) if 0 in (b01, b10) else b01 / b10
    return {"n": int(x.size), "a_rate": float(x.mean()) if x.size else math.nan,
            "b_rate": float(y.mean()) if y.size else math.nan, "improved": b01, "worsened": b10,
            "diff": float(y.mean() - x.mean()) if x.size else math.nan, "odds_ratio": float(ratio), "p": float(p),
            "test": "exact McNemar (binomial)"}


def sign_flip_test(d, *, rounds: int = 10_000, seed: int = 0) -> tuple[float, str]:
    """Two-sided paired sign-flip permutation test of mean(d) = 0: (p, which test).

    p = share of sign flips of the differences whose |mean| reaches the observed |mean|. Zero differences
    are dropped (flipping them changes nothing, so p is unchanged). Up to EXACT_MAX_N nonzero differences
    all 2^n flips are enumerated (exact p, at least 2 / 2^n); above that `rounds` random flips with the
    (hits + 1) / (rounds + 1) correction. p is never 0."""
    d = np.asarray(d, dtype=np.float64)
    d = d[d != 0]
    if d.size == 0:
        return 1.0, "sign-flip permutation (no nonzero difference)"
    exact = d.size <= EXACT_MAX_N
    if exact:
        bits = (np.arange(2 ** d.size)[:, None] >> np.arange(d.size)) & 1
    else:
        bits = np.random.default_rng(seed).integers(0, 2, size=(rounds, d.size), dtype=np.int8)
    flipped = np.abs(d.sum() - 2.0 * (bits @ d))              # |sum| of each flip (bit 1 = flipped); n cancels
    hits = int((flipped >= abs(d.sum()) * (1 - REL_TOL)).sum())
    if exact:
        return hits / 2 ** d.size, f"sign-flip permutation (exact, 2^{d.size})"
    return (hits + 1) / (rounds + 1), f"sign-flip permutation (Monte Carlo, {rounds} flips, (hits+1)/(rounds+1))"


def paired_test(a, b, *, rounds: int = 10_000, seed: int = 0, level: float = 0.95) -> dict:
    """Paired comparison of mean(b - a): bootstrap percentile CI, two-sided sign-flip permutation p
    (`test` says exact or Monte Carlo) and Cohen's d_z (mean difference / std of differences)."""
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    if d.size == 0:
        return {"n": 0, "diff": math.nan, "lo": math.nan, "hi": math.nan, "p": math.nan, "cohen_dz": math.nan,
                "test": "none (no pairs)"}
    lo, hi = percentile_ci(resample_counts(d.size, rounds, seed) @ d / d.size, level)
    p, test = sign_flip_test(d, rounds=rounds, seed=seed)
    sd = float(d.std(ddof=1)) if d.size > 1 else 0.0
    return {"n": int(d.size), "a_mean": float(np.mean(a)), "b_mean": float(np.mean(b)), "diff": float(d.mean()),
            "lo": lo, "hi": hi, "ci": "paired bootstrap percentile", "p": p, "test": test,
            "cohen_dz": float(d.mean() / sd) if sd > 0 else math.nan}
