"""Every statistical test rolemrc prints a p-value or CI from, in one place (numpy/scipy, vectorised; the per-unit
tests of `probe diff` run on torch tensors over all units at once):

- bootstrap CIs (plain or stratified) and per-item means; the hierarchical bootstrap over seeds then cases, and the
  verdict over seeds of per-seed estimates;
- a cell's placement among its random-unit controls (percentile, gap to their median with a CI);
- paired tests: exact McNemar on paired binary outcomes (eval's verdicts, probe's per-unit activity), the paired
  sign-flip permutation test with a paired bootstrap CI (eval, sweep), the paired t-test from streamed sums (probe);
- unpaired tests: Welch's t on cluster (user) means with a bootstrap CI (A/B), the pooled two-proportion z-test and
  Welch's t from streamed moments (probe), whether groups' rates differ (Fisher's exact or chi-square: A/B refusals);
- multiplicity: Benjamini-Hochberg (probe), Holm (sweep).

A result names its test by a code (`"test"`, also in probe diff files); TEST_LABELS holds the prose reports print.

McNemar's convention, everywhere: b01 counts pairs 0 under A and 1 under B (B gained), b10 pairs 1 under A and 0
under B; a positive statistic means more under B."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# test code -> its label in reports; "none": no valid test, so no p-value
TEST_LABELS: dict[str, str] = {
    "mcnemar": "exact McNemar",
    "sign-flip": "paired sign-flip permutation",
    "paired-t": "paired t-test",
    "two-proportion-z": "pooled two-proportion z-test",
    "welch-t": "Welch's t-test",
    "fisher-exact": "Fisher's exact test",
    "chi-square": "Pearson's chi-square test",
    "none": "no test",
}
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


Ratio = Callable[[np.ndarray, np.ndarray], np.ndarray]   # (numerator means, denominator means) -> statistic


def hierarchical_bootstrap(data: Sequence, denominator: Sequence | None = None, *, stat: Ratio = np.divide,
                           rounds: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """CI of a statistic of clustered data: data[s] holds seed s's per-case values (seeds may have different case
    counts). Each round draws the seeds with replacement, then, each time a seed is drawn, its cases with replacement;
    the seed's case mean counts once per draw. The estimate is stat(mean over seeds of the case means of `data`, the
    same of `denominator`): paired per case with `data`, default 1 per case, and stat defaults to their ratio, so
    without a denominator it is the mean and with one a ratio estimator (restoration 1 - KL_cell / KL_dpo:
    stat=lambda n, d: 1 - n / d). One seed: exactly the cases bootstrap (`mean_ci`, same seed). Rounds where stat is
    undefined are left out. Returns {estimate, lo, hi, seeds, cases}."""
    nums = [np.asarray(x, dtype=np.float64).ravel() for x in data]
    dens = [np.ones_like(x) for x in nums] if denominator is None else \
        [np.asarray(x, dtype=np.float64).ravel() for x in denominator]
    if len(dens) != len(nums) or any(d.shape != x.shape for d, x in zip(dens, nums)):
        raise ValueError("the denominator needs a value per case of every seed, paired with the data")
    nums, dens = [x for x in nums if x.size], [d for d in dens if d.size]   # a seed without cases has no mean
    seeds = len(nums)
    out = {"seeds": seeds, "cases": sum(x.size for x in nums)}
    if not seeds:
        return out | {"estimate": math.nan, "lo": math.nan, "hi": math.nan}
    drawn = np.random.default_rng([seed, 1]).multinomial(seeds, np.full(seeds, 1.0 / seeds), size=rounds)
    cases = np.random.default_rng(seed)            # the cases' stream: `resample_counts`'s with one seed
    num, den = np.zeros(rounds), np.zeros(rounds)
    for s, (x, d) in enumerate(zip(nums, dens)):   # the sum over a seed's draws of their case means
        w = cases.multinomial(drawn[:, s] * x.size, np.full(x.size, 1.0 / x.size))
        num += w @ x / x.size
        den += w @ d / x.size
    with np.errstate(invalid="ignore", divide="ignore"):
        lo, hi = percentile_ci(stat(num / seeds, den / seeds), level)
        estimate = stat(np.mean([x.mean() for x in nums]), np.mean([d.mean() for d in dens]))
    return out | {"estimate": float(estimate), "lo": lo, "hi": hi}


def t_interval(values: Sequence[float], level: float = 0.95) -> dict:
    """The mean of per-seed estimates (NaNs left out) with its Student-t CI over them; lo and hi are None below two."""
    from scipy.stats import t as student

    x = np.asarray(values, dtype=float)
    x = x[~np.isnan(x)]
    mean, n = (float(x.mean()) if x.size else math.nan), int(x.size)
    if n < 2:
        return {"mean": mean, "lo": None, "hi": None, "n": n}
    half = float(student.ppf((1 + level) / 2, n - 1) * x.std(ddof=1) / math.sqrt(n))
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n}


def seed_verdict(data: Sequence, denominator: Sequence | None = None, *, stat: Ratio = np.divide, null: float = 0.0,
                 rounds: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """The verdict over seeds: each seed's estimate with its cases-bootstrap CI (`hierarchical_bootstrap` of that
    seed alone), the mean of the per-seed estimates with its Student-t CI over seeds (NaN below two seeds), and how
    many seeds' CIs lie wholly above and below `null`."""
    dens = [None] * len(data) if denominator is None else list(denominator)
    per_seed = [hierarchical_bootstrap([x], None if d is None else [d], stat=stat, rounds=rounds, seed=seed,
                                       level=level) for x, d in zip(data, dens)]
    over = t_interval([e["estimate"] for e in per_seed if e["seeds"]], level)
    lo, hi = (math.nan if over[k] is None else over[k] for k in ("lo", "hi"))
    return {"per_seed": per_seed, "seeds": over["n"], "mean": over["mean"], "lo": lo, "hi": hi,
            "ci": "Student t over seeds", "above": sum(e["lo"] > null for e in per_seed),
            "below": sum(e["hi"] < null for e in per_seed)}


def control_placement(cell, controls, *, rounds: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """Where a cell falls among its K random-unit controls, from per-case scores on the same cases (cell [cases],
    controls [K, cases]): the cell mean's percentile among the controls' means (the share below it, ties half,
    x 100), and its gap to the controls' median with a bootstrap CI that resamples the cases (the same for cell and
    controls) and the controls (with replacement)."""
    x = np.asarray(cell, dtype=np.float64)
    c = np.asarray(controls, dtype=np.float64).reshape(-1, x.size)
    k, n = c.shape
    if not k or not n:
        return {"k": k, "n": n, "percentile": math.nan, "gap": math.nan, "lo": math.nan, "hi": math.nan}
    means, mean = c.mean(1), float(x.mean())
    median = float(np.median(means))
    w = resample_counts(n, rounds, seed)                                       # [rounds, cases]
    pick = np.random.default_rng([seed, 1]).integers(0, k, size=(rounds, k))   # controls, with replacement
    gaps = w @ x / n - np.median(np.take_along_axis((c @ w.T / n).T, pick, axis=1), axis=1)
    lo, hi = percentile_ci(gaps, level)
    return {"k": k, "n": n, "cell_mean": mean, "controls_median": median, "controls_min": float(means.min()),
            "controls_max": float(means.max()),
            "percentile": float(100 * ((means < mean).sum() + 0.5 * (means == mean).sum()) / k),
            "gap": mean - median, "lo": lo, "hi": hi, "ci": "bootstrap over cases and controls"}


def rate_upper_bound(hits: int, n: int, level: float = 0.95) -> float:
    """The exact one-sided upper confidence bound on a rate seen `hits` times in `n` trials (Clopper-Pearson): what a
    count of false positives bounds the false-positive rate at. 0 of n bounds it at 1 - (1 - level)^(1/n)."""
    from scipy.stats import beta

    if n < 1:
        return 1.0
    return 1.0 if hits >= n else float(beta.ppf(level, hits + 1, n - hits))


def trials_for_bound(rate: float, level: float = 0.95) -> int:
    """The fewest clean trials (0 hits) whose `rate_upper_bound` is at most `rate`: 59 for 5% at 95%."""
    return math.ceil(math.log(1 - level) / math.log(1 - rate))


def mcnemar(b01, b10) -> tuple[np.ndarray, np.ndarray]:
    """Exact McNemar test, elementwise over arrays of discordant counts (b01: 0 under A, 1 under B; b10: the reverse):
    the two-sided binomial test of b01 among b01 + b10 at 1/2 (= scipy.stats.binomtest). Returns the signed statistic
    (b01 - b10) / sqrt(b01 + b10) (0 without discordant pairs) and p."""
    from scipy.stats import binom

    b01, b10 = np.asarray(b01, dtype=np.float64), np.asarray(b10, dtype=np.float64)
    n = b01 + b10
    p = np.minimum(binom.cdf(np.minimum(b01, b10), n, 0.5) * 2, 1.0)
    stat = np.where(n > 0, (b01 - b10) / np.sqrt(np.maximum(n, 1)), 0.0)
    return stat, p


def mcnemar_outcomes(a: list[int], b: list[int]) -> dict:
    """`mcnemar` on paired binary outcomes a -> b, with effect sizes: improved = b01, worsened = b10, the rates and
    their difference, and the odds ratio b01/b10 (Haldane's 0.5 correction when a cell is 0)."""
    x, y = np.asarray(a, dtype=int), np.asarray(b, dtype=int)
    if x.shape != y.shape:
        raise ValueError("McNemar needs paired outcomes of equal length")
    b01, b10 = int(((x == 0) & (y == 1)).sum()), int(((x == 1) & (y == 0)).sum())
    ratio = (b01 + 0.5) / (b10 + 0.5) if 0 in (b01, b10) else b01 / b10
    return {"n": int(x.size), "a_rate": float(x.mean()) if x.size else math.nan,
            "b_rate": float(y.mean()) if y.size else math.nan, "improved": b01, "worsened": b10,
            "diff": float(y.mean() - x.mean()) if x.size else math.nan, "odds_ratio": float(ratio),
            "p": float(mcnemar(b01, b10)[1]), "test": "mcnemar"}


def sign_flip_test(d, *, rounds: int = 10_000, seed: int = 0) -> tuple[float, str]:
    """Two-sided paired sign-flip permutation test of mean(d) = 0: (p, how p was computed).

    p = share of sign flips of the differences whose |mean| reaches the observed |mean|. Zero differences
    are dropped (flipping them changes nothing, so p is unchanged). Up to EXACT_MAX_N nonzero differences
    all 2^n flips are enumerated (exact p, at least 2 / 2^n); above that `rounds` random flips with the
    (hits + 1) / (rounds + 1) correction. p is never 0."""
    d = np.asarray(d, dtype=np.float64)
    d = d[d != 0]
    if d.size == 0:
        return 1.0, "no nonzero difference"
    exact = d.size <= EXACT_MAX_N
    if exact:
        bits = (np.arange(2 ** d.size)[:, None] >> np.arange(d.size)) & 1
    else:
        bits = np.random.default_rng(seed).integers(0, 2, size=(rounds, d.size), dtype=np.int8)
    flipped = np.abs(d.sum() - 2.0 * (bits @ d))              # |sum| of each flip (bit 1 = flipped); n cancels
    hits = int((flipped >= abs(d.sum()) * (1 - REL_TOL)).sum())
    if exact:
        return hits / 2 ** d.size, f"exact, 2^{d.size}"
    return (hits + 1) / (rounds + 1), f"Monte Carlo, {rounds} flips, (hits+1)/(rounds+1)"


def paired_test(a, b, *, rounds: int = 10_000, seed: int = 0, level: float = 0.95) -> dict:
    """Paired comparison of mean(b - a): bootstrap percentile CI, two-sided sign-flip permutation p
    (`p_method` says exact or Monte Carlo) and Cohen's d_z (mean difference / std of differences)."""
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    if d.size == 0:
        return {"n": 0, "diff": math.nan, "lo": math.nan, "hi": math.nan, "p": math.nan, "cohen_dz": math.nan,
                "test": "none", "p_method": "no pairs"}
    lo, hi = percentile_ci(resample_counts(d.size, rounds, seed) @ d / d.size, level)
    p, method = sign_flip_test(d, rounds=rounds, seed=seed)
    sd = float(d.std(ddof=1)) if d.size > 1 else 0.0
    return {"n": int(d.size), "a_mean": float(np.mean(a)), "b_mean": float(np.mean(b)), "diff": float(d.mean()),
            "lo": lo, "hi": hi, "ci": "paired bootstrap percentile", "p": p, "test": "sign-flip",
            "p_method": method,
            "cohen_dz": float(d.mean() / sd) if sd > 0 else math.nan}


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
    out = {"test": "welch-t", "n_a": int(x.size), "n_b": int(y.size),
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


def rates_test(hits: Sequence[int], totals: Sequence[int]) -> dict:
    """Whether groups' rates hits/totals differ: two groups, Fisher's exact test (two-sided); more, Pearson's
    chi-square test of the groups x (hit, miss) table. Groups with no trials are left out; with fewer than two left
    there is no test (p NaN); when every group hits never (or always) the rates are equal (p = 1)."""
    from scipy.stats import chi2_contingency, fisher_exact

    table = [(int(h), int(t) - int(h)) for h, t in zip(hits, totals) if t > 0]
    if len(table) < 2:
        return {"test": "none", "p": math.nan, "groups": len(table)}
    test = "fisher-exact" if len(table) == 2 else "chi-square"
    if not sum(h for h, _ in table) or not sum(m for _, m in table):
        return {"test": test, "p": 1.0, "groups": len(table)}
    if test == "fisher-exact":
        return {"test": test, "p": float(fisher_exact(table).pvalue), "groups": 2}
    result = chi2_contingency(table, correction=False)
    return {"test": test, "p": float(result.pvalue), "statistic": float(result.statistic), "dof": int(result.dof),
            "groups": len(table)}


def two_proportion_test(count_a: torch.Tensor, n_a: int, count_b: torch.Tensor, n_b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pooled two-proportion z-test per element; returns (z, two-sided p). Units never (or always)
    active in both samples have no variance: z = 0, p = 1."""
    import torch

    ca, cb = count_a.double(), count_b.double()
    pooled = (ca + cb) / (n_a + n_b)
    se = torch.sqrt(pooled * (1 - pooled) * (1.0 / n_a + 1.0 / n_b))
    delta = cb / n_b - ca / n_a
    z = torch.where(se > 0, delta / se.clamp_min(1e-300), torch.zeros_like(se))
    p = torch.special.erfc(z.abs() / math.sqrt(2.0))
    return z, p.clamp(0.0, 1.0)


def paired_t_test(total: torch.Tensor, squares: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Paired t-test per element from streamed sums over n cases of d and d^2 (= scipy.stats.ttest_rel).
    Returns (t, two-sided p). No variance: t = 0, p = 1 where the mean is 0 (or n < 2), else t = +-inf, p = 0."""
    import torch
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


def welch_t_test(mean_a: torch.Tensor, var_a: torch.Tensor, n_a: int, mean_b: torch.Tensor, var_b: torch.Tensor,
                 n_b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Welch's t-test of b - a per element from each side's mean, sample variance and size
    (= scipy.stats.ttest_ind_from_stats(equal_var=False)); returns (t, two-sided p). No variance: t = 0, p = 1 where
    the means are equal (or a side has fewer than 2 observations), else t = +-inf, p = 0."""
    import torch
    from scipy.stats import t as student

    mean_a, var_a, mean_b, var_b = (x.double().cpu() for x in (mean_a, var_a, mean_b, var_b))
    if min(n_a, n_b) < 2:
        return torch.zeros_like(mean_a), torch.ones_like(mean_a)
    share_a, share_b = var_a / n_a, var_b / n_b
    se2, diff = share_a + share_b, mean_b - mean_a
    flat = se2 == 0
    satterthwaite = se2 ** 2 / (share_a ** 2 / (n_a - 1) + share_b ** 2 / (n_b - 1)).clamp_min(1e-300)
    df = torch.where(flat, torch.ones_like(se2), satterthwaite)
    t = torch.where(flat, torch.sign(diff) * torch.inf, diff / se2.sqrt().clamp_min(1e-300))
    t = torch.where(diff == 0, torch.zeros_like(t), t)
    p = torch.from_numpy(2 * student.sf(t.abs().numpy(), df.numpy()))
    return t, p.clamp(0.0, 1.0)


def benjamini_hochberg(p: torch.Tensor) -> torch.Tensor:
    """BH-adjusted q-values over all elements of `p` (any shape)."""
    import torch

    flat = p.reshape(-1).double()
    m = flat.numel()
    order = torch.argsort(flat)
    ranked = flat[order] * m / torch.arange(1, m + 1, dtype=torch.float64, device=flat.device)
    ranked = torch.flip(torch.cummin(torch.flip(ranked, [0]), 0).values, [0]).clamp(max=1.0)
    q = torch.empty_like(flat)
    q[order] = ranked
    return q.reshape(p.shape)


def holm(pvalues: list[float], family: int | None = None) -> list[float]:
    """Holm-Bonferroni adjusted p-values (step-down, monotone, capped at 1), in the input order; NaN stays NaN.
    `family`: the number of tests declared, when some of them did not run (each counts as p = 1, so the correction of
    those that ran does not depend on how many others ran); default the finite p-values given."""
    p = np.asarray(pvalues, dtype=np.float64)
    finite = np.flatnonzero(~np.isnan(p))
    order = finite[np.argsort(p[finite], kind="stable")]
    m = len(order)
    if family is not None and family < m:
        raise ValueError(f"a Holm family of {family} tests cannot hold the {m} given")
    size = m if family is None else family
    adjusted = np.maximum.accumulate(np.minimum(1.0, (size - np.arange(m)) * p[order])) if m else np.array([])
    out = p.copy()
    out[order] = adjusted
    return out.tolist()
