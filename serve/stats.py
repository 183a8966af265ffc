"""Unpaired tests between A/B arms (their traffic sets differ, so paired tests do not apply)."""

from __future__ import annotations

import math

import numpy as np
import torch

from rolemrc.eval.stats import percentile_ci, resample_counts
from rolemrc.probe.stats import two_proportion_test


def welch(a: list[float], b: list[float], *, rounds: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """Difference of means b - a: Welch's t-test p and a bootstrap CI resampling each arm on its own."""
    from scipy.stats import ttest_ind

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    out = {"test": "welch_t", "n_a": int(x.size), "n_b": int(y.size),
           "a_mean": float(x.mean()) if x.size else math.nan, "b_mean": float(y.mean()) if y.size else math.nan}
    if x.size < 2 or y.size < 2:
        return out | {"diff": out["b_mean"] - out["a_mean"], "lo": math.nan, "hi": math.nan, "p": math.nan}
    boot = (resample_counts(y.size, rounds, seed + 1) @ y / y.size) - (resample_counts(x.size, rounds, seed) @ x / x.size)
    lo, hi = percentile_ci(boot, level)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = ttest_ind(y, x, equal_var=False).pvalue
    p = float(p) if np.isfinite(p) else (1.0 if float(y.mean()) == float(x.mean()) else 0.0)
    return out | {"diff": float(y.mean() - x.mean()), "lo": lo, "hi": hi, "p": p}


def proportions(k_a: int, n_a: int, k_b: int, n_b: int) -> dict:
    """Pooled two-proportion z-test of rate b vs rate a."""
    out = {"test": "two_proportion_z", "n_a": n_a, "n_b": n_b, "a_rate": k_a / n_a if n_a else math.nan,
           "b_rate": k_b / n_b if n_b else math.nan}
    if not n_a or not n_b:
        return out | {"diff": math.nan, "z": math.nan, "p": math.nan}
    z, p = two_proportion_test(torch.tensor([k_a]), n_a, torch.tensor([k_b]), n_b)
    return out | {"diff": out["b_rate"] - out["a_rate"], "z": float(z[0]), "p": float(p[0])}
