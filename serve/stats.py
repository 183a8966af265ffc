"""Unpaired tests between A/B arms (their traffic sets differ, so paired tests do not apply), with the user
as the unit: arms are assigned per user, so a user's requests are one cluster, not independent samples."""

from __future__ import annotations

import math
import warnings

import numpy as np

from rolemrc.eval.stats import percentile_ci, resample_counts


def cluster_means(values, clusters) -> np.ndarray:
    """Mean of each cluster's values (clusters in sorted label order): one value per user."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return x
    _, code = np.unique(np.asarray(clusters), return_inverse=True)
    return np.bincount(code, weights=x) / np.bincount(code)


def welch(a: list[float], b: list[float], *, rounds: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """Difference of means b - a: Welch's t-test p (analytic) and a bootstrap CI resampling each arm on its
    own. Given per-user means, the bootstrap resamples users with all their requests (a cluster bootstrap)."""
    from scipy.stats import ttest_ind

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    out = {"test": "welch_t", "n_a": int(x.size), "n_b": int(y.size),
           "a_mean": float(x.mean()) if x.size else math.nan, "b_mean": float(y.mean()) if y.size else math.nan}
    if x.size < 2 or y.size < 2:
        return out | {"diff": out["b_mean"] - out["a_mean"], "lo": math.nan, "hi": math.nan, "p": math.nan}
    boot = (resample_counts(y.size, rounds, seed + 1) @ y / y.size) - (resample_counts(x.size, rounds, seed) @ x / x.size)
    lo, hi = percentile_ci(boot, level)
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)    # constant arms: NaN p, handled below
        p = ttest_ind(y, x, equal_var=False).pvalue
    p = float(p) if np.isfinite(p) else (1.0 if float(y.mean()) == float(x.mean()) else 0.0)
    return out | {"diff": float(y.mean() - x.mean()), "lo": lo, "hi": hi, "p": p}
