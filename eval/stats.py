"""Bootstrap confidence intervals, exact McNemar and the paired bootstrap (numpy/scipy, vectorised)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np


def resample_counts(n: int, rounds: int, seed: int) -> np.ndarray:
    """[rounds, n] multiplicity of each item in `rounds` bootstrap resamples of n items."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n, np.full(n, 1.0 / n), size=rounds).astype(np.float64)


def percentile_ci(samples: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of bootstrap samples, ignoring resamples where the statistic is undefined."""
    samples = samples[np.isfinite(samples)]
    if samples.size == 0:
        return math.nan, math.nan
    lo, hi = np.quantile(samples, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


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
            "diff": float(y.mean() - x.mean()) if x.size else math.nan, "odds_ratio": float(ratio), "p": float(p)}


def paired_bootstrap(a, b, *, rounds: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """Paired bootstrap of mean(b - a): CI, two-sided p (how often the resampled difference crosses 0),
    and Cohen's d_z (mean difference / std of differences)."""
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    if d.size == 0:
        return {"n": 0, "diff": math.nan, "lo": math.nan, "hi": math.nan, "p": math.nan, "cohen_dz": math.nan}
    samples = resample_counts(d.size, rounds, seed) @ d / d.size
    lo, hi = percentile_ci(samples, level)
    p = min(1.0, 2 * min(float((samples <= 0).mean()), float((samples >= 0).mean())))
    sd = float(d.std(ddof=1)) if d.size > 1 else 0.0
    return {"n": int(d.size), "a_mean": float(np.mean(a)), "b_mean": float(np.mean(b)), "diff": float(d.mean()),
            "lo": lo, "hi": hi, "p": p, "cohen_dz": float(d.mean() / sd) if sd > 0 else math.nan}
