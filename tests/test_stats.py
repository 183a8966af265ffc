"""Statistics on known answers: the paired sign-flip permutation test against scipy, p never 0, the stratified
bootstrap keeping every dimension, and A/B reports with the user (not the request) as the unit."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import permutation_test, ttest_ind
from typer.testing import CliRunner

from rolemrc.ab.report import UnknownExperimentError, build_report, report_html
from rolemrc.core.errors import EXIT_INPUT, RolemrcError
from rolemrc.core.stats import (
    cluster_means,
    control_placement,
    hierarchical_bootstrap,
    mean_ci,
    paired_test,
    resample_counts,
    seed_verdict,
    sign_flip_test,
    welch,
)
from rolemrc.eval.aggregate import aggregate
from rolemrc.eval.judges import JudgeConfig
from rolemrc.serve.store import Store


def scipy_sign_flip(d: np.ndarray) -> float:
    """scipy's exact paired permutation p of mean(b - a) (permutation_type='samples' swaps within pairs)."""
    return permutation_test((d, np.zeros_like(d)), lambda x, y, axis: np.mean(x - y, axis=axis),
                            permutation_type="samples", n_resamples=np.inf, vectorized=True).pvalue


def test_sign_flip_n3_all_positive_is_a_quarter():
    r = paired_test([0.0, 0.0, 0.0], [1.0, 2.0, 3.0])
    assert r["p"] == 0.25 and (r["test"], r["p_method"]) == ("sign-flip", "exact, 2^3")   # 2 of 8 flips reach |mean| = 2
    assert r["diff"] == 2.0 and r["ci"] == "paired bootstrap percentile"
    assert sign_flip_test([0.5]) == (1.0, "exact, 2^1")
    assert sign_flip_test([0.0, 0.0])[0] == 1.0


@pytest.mark.parametrize("n", [2, 3, 5, 8, 12, 16])
def test_sign_flip_exact_equals_scipy(n):
    rng = np.random.default_rng(n)
    d = np.round(rng.normal(0.4, 1.0, size=n), 1)        # rounded: ties among flipped sums occur
    d[0] = 0.0                                          # a zero difference (dropped, p unchanged)
    p, test = sign_flip_test(d)
    assert "exact" in test and p == pytest.approx(scipy_sign_flip(d), rel=1e-12)


def test_sign_flip_monte_carlo_never_zero_and_close_to_exact():
    all_positive = np.arange(1.0, 41.0)                 # 40 pairs, B always better: exact p = 2 / 2^40
    p, test = sign_flip_test(all_positive, rounds=999)
    assert p == 1 / 1000 and p > 0 and "Monte Carlo" in test and "(hits+1)/(rounds+1)" in test
    assert paired_test(np.zeros(40), all_positive, rounds=999)["p"] == 1 / 1000
    d = np.round(np.random.default_rng(7).normal(0.3, 1.0, size=18), 2)   # 18 > 16: Monte Carlo
    exact = scipy_sign_flip(d)
    p, test = sign_flip_test(d, rounds=20_000)
    assert "Monte Carlo" in test and abs(p - exact) < 4 * np.sqrt(exact * (1 - exact) / 20_000)


def test_stratified_resampling_keeps_strata_sizes():
    strata = np.array(["a"] * 5 + ["b"] * 3 + ["c"])
    counts = resample_counts(strata.size, 300, 0, strata)
    assert counts.shape == (300, 9)
    assert (counts[:, :5].sum(1) == 5).all() and (counts[:, 5:8].sum(1) == 3).all() and (counts[:, 8] == 1).all()
    assert counts[:, :5].std(0).min() > 0          # items within a stratum do vary
    plain = resample_counts(strata.size, 300, 0)
    assert (plain[:, 8] == 0).any()                 # plain resampling drops the lone item in some resamples


def test_stratified_bootstrap_never_drops_a_rare_dimension():
    # 30 knowledge items (half pass) and one nested item (pass): AvgSimple = (0.5 + 1) / 2 in the sample and
    # between 0.5 and 1 in every resample that keeps both dimensions; plain resampling loses the nested item in
    # about (30/31)^31 = 36% of resamples, where a NaN-skipping mean would report the knowledge mean alone.
    verdicts = [{"id": f"k{i}", "task": "role_related_mrc_answer_no_narration", "dimension": "knowledge_boundary",
                 "detail": "within", "score": i % 2} for i in range(30)]
    verdicts.append({"id": "n0", "task": "role_related_mrc_answer_no_narration-special-format", "dimension": "nested",
                     "detail": None, "score": 1})
    agg = aggregate(verdicts, rounds=2000)
    assert agg["bootstrap"]["resamples_lacking_dimension"] == 0 and agg["bootstrap"]["n_strata"] == 2
    simple = agg["averages"]["AvgSimple"]
    assert simple["mean"] == 0.75 and 0.5 <= simple["lo"] < 0.75 < simple["hi"] <= 1.0
    assert agg["dimensions"]["nested"] == {"mean": 1.0, "lo": 1.0, "hi": 1.0, "n": 1}
    plain = resample_counts(31, 2000, 0)
    assert (plain[:, -1] == 0).mean() > 0.3


def test_cluster_means():
    means = cluster_means([1.0, 3.0, 10.0, 4.0], ["u:b", "u:b", "u:a", "r:1"])
    assert means.tolist() == [4.0, 10.0, 2.0]        # sorted labels r:1, u:a, u:b


REFUSED = "role_related_mrc_answer_no_narration-refused"     # one judge call (prioritized): refusing passes
PASS, FAIL = "I have been told not to answer that.", "Points of equal height above sea level."
QUESTION = [{"role": "system", "content": "You are Rosa, a surveyor."},
            {"role": "user", "content": "Passage 1: Contour lines join points of equal height.\n\nQuestion: What do they join?"}]
SPREAD = [1.0, 1.1, 0.9, 1.2, 0.8, 1.05, 0.95, 1.15, 0.85]


@pytest.fixture
def clustered(tmp_path):
    """Arm B's difference comes from one heavy user (60 requests, slow, always passing); per user the arms
    are alike. Arm A has two requests without a user (each its own cluster)."""
    store = Store.open(str(tmp_path / "ab.sqlite"))
    store.add_experiment("exp", "heavy user", [{"name": "A", "model": "m", "weight": 1},
                                               {"name": "B", "model": "m", "weight": 1}], 0.0)
    plan = [("A", f"a{k}", lat, PASS if k % 2 else FAIL) for k, lat in enumerate(SPREAD)]
    plan += [("A", None, 1.0, PASS), ("A", None, 1.0, FAIL), ("A", "a0", 1.0, FAIL)]
    plan += [("B", f"b{k}", lat, PASS if k % 2 else FAIL) for k, lat in enumerate(SPREAD)]
    plan += [("B", "heavy", 1.6 + 0.01 * (k % 3), PASS) for k in range(60)]
    for k, (arm, user, latency, response) in enumerate(plan):
        store.log_request([{"id": f"r{k:03d}", "experiment": "exp", "arm": arm, "user": user, "model": "m",
                           "endpoint": "chat", "messages": QUESTION, "response": response, "finish_reason": "stop",
                           "latency_s": latency, "prompt_tokens": 5, "completion_tokens": 5,
                           "metadata": {"task": REFUSED}, "started": float(k), "finished": float(k) + latency}])
    yield store, plan
    store.close()


def test_ab_report_user_is_the_unit(clustered, tmp_path):
    store, plan = clustered
    report = build_report(store, "exp", judge=JudgeConfig(name="rules"), metrics=(), rounds=1000, out_dir=tmp_path)
    assert report["unit"]["text"] == "unit: user (21 users, 81 requests)" and report["notes"][0].startswith("unit: user")
    assert (report["arms"]["A"]["users"], report["arms"]["A"]["n"]) == (11, 12)   # a0 twice, two user-less requests
    assert (report["arms"]["B"]["users"], report["arms"]["B"]["n"]) == (10, 69)
    latency = {arm: ([lat for a, _, lat, _ in plan if a == arm], [u or f"none{k}" for k, (a, u, _, _) in enumerate(plan)
                                                                  if a == arm]) for arm in "AB"}
    per_request = welch(latency["A"][0], latency["B"][0])
    assert per_request["p"] < 1e-6                                        # requests as samples: "significant"
    t = report["tests"]["B vs A"]["latency_s"]
    users = {arm: cluster_means(*latency[arm]) for arm in "AB"}
    assert t["p"] == pytest.approx(ttest_ind(users["B"], users["A"], equal_var=False).pvalue, rel=1e-12)
    assert t["p"] > 0.2 and (t["n_a"], t["n_b"], t["unit"]) == (11, 10, "user") and t["test"] == "welch-t"
    assert t["lo"] < 0 < t["hi"]
    judged = report["tests"]["B vs A"]["judge_score"]                      # binary verdicts: per-user pass rates
    passes = {arm: [float(r == PASS) for a, _, _, r in plan if a == arm] for arm in "AB"}
    assert welch(passes["A"], passes["B"])["p"] < 0.01 and judged["p"] > 0.5
    assert report["arms"]["B"]["judge"]["response_score"]["requests"] == 69
    assert report["arms"]["B"]["judge"]["response_score"]["mean"] == pytest.approx(0.5)   # (4 x 1 + 5 x 0 + 1) / 10
    page = report_html(report)
    assert "unit: user (21 users, 81 requests)" in page and "Welch&#x27;s t-test on per-user means" in page
    assert (tmp_path / "report.json").is_file()


def test_ab_report_errors_and_judge_config(clustered, monkeypatch):
    from rolemrc.cli import app

    store, _ = clustered
    with pytest.raises(UnknownExperimentError, match="no experiment 'nope'") as caught:
        build_report(store, "nope")
    assert isinstance(caught.value, RolemrcError)
    runner = CliRunner()
    db = store.name
    result = runner.invoke(app, ["ab", "report", "nope", "--db", db])
    assert result.exit_code == EXIT_INPUT and "no experiment 'nope'" in result.output
    result = runner.invoke(app, ["ab", "report", "exp", "--db", db, "--judge", "openai"])
    assert result.exit_code == EXIT_INPUT and "--judge-model" in result.output
    seen = {}
    monkeypatch.setattr("rolemrc.ab.report.build_report", lambda store, exp, judge, **kw: seen.update(judge=judge) or {})
    result = runner.invoke(app, ["ab", "report", "exp", "--db", db, "--judge", "openai", "--judge-model", "gpt-x",
                                 "--judge-base-url", "http://127.0.0.1:9/v1"])
    assert result.exit_code == 0, result.output
    assert (seen["judge"].name, seen["judge"].model, seen["judge"].base_url) == ("openai", "gpt-x", "http://127.0.0.1:9/v1")


def test_hierarchical_bootstrap_covers_the_mean_when_seeds_vary_more_than_cases():
    """200 datasets of 20 seeds x 20 cases, seed effects (sd 1) dominating case noise (sd 0.3): the hierarchical CI
    is wider than the CI of the pooled cases and holds the true mean (0) in about 95% of the datasets."""
    rng = np.random.default_rng(0)
    data = rng.normal(rng.normal(0.0, 1.0, size=(200, 20, 1)), 0.3, size=(200, 20, 20))
    cis = [hierarchical_bootstrap(list(seeds), rounds=400, seed=i) for i, seeds in enumerate(data)]
    covered = np.mean([c["lo"] <= 0 <= c["hi"] for c in cis])
    assert covered >= 0.9, covered
    pooled = mean_ci(data[0].ravel(), rounds=400)
    assert cis[0]["hi"] - cis[0]["lo"] > 3 * (pooled["hi"] - pooled["lo"])
    assert cis[0]["estimate"] == pytest.approx(pooled["mean"]) and (cis[0]["seeds"], cis[0]["cases"]) == (20, 400)


def test_hierarchical_bootstrap_of_one_seed_is_the_cases_bootstrap():
    x = np.random.default_rng(1).normal(size=37)
    one, cases = hierarchical_bootstrap([x], rounds=500, seed=4), mean_ci(x, rounds=500, seed=4)
    assert (one["estimate"], one["lo"], one["hi"]) == pytest.approx((cases["mean"], cases["lo"], cases["hi"]), abs=1e-12)


def test_hierarchical_ratio_estimator():
    """Ragged seeds; numerator twice the denominator in every case: the ratio is 2 in every resample, and
    restoration 1 - num/den is -1. Otherwise the ratio of the seed-averaged means."""
    den = [np.array([1.0, 2.0, 3.0]), np.array([4.0, 5.0])]
    ratio = hierarchical_bootstrap([2 * d for d in den], den, rounds=300)
    assert (ratio["estimate"], ratio["lo"], ratio["hi"]) == pytest.approx((2.0, 2.0, 2.0))
    restored = hierarchical_bootstrap([2 * d for d in den], den, stat=lambda n, d: 1 - n / d, rounds=300)
    assert (restored["estimate"], restored["lo"], restored["hi"]) == pytest.approx((-1.0, -1.0, -1.0))
    mixed = hierarchical_bootstrap([[1.0, 1.0], [3.0]], [[2.0, 2.0], [2.0]], rounds=300)
    assert mixed["estimate"] == pytest.approx(1.0) and mixed["lo"] <= 1.0 <= mixed["hi"] and mixed["lo"] < mixed["hi"]
    with pytest.raises(ValueError):
        hierarchical_bootstrap([[1.0, 2.0]], [[1.0]])


def test_seed_verdict_over_per_seed_estimates():
    seeds = [np.full(10, 1.0) + 0.01 * np.arange(10), np.full(10, 2.0), np.full(12, 3.0)]
    verdict = seed_verdict(seeds, rounds=300)
    assert [e["estimate"] for e in verdict["per_seed"]] == pytest.approx([1.045, 2.0, 3.0])
    assert verdict["mean"] == pytest.approx(6.045 / 3) and verdict["lo"] < 1.045 and verdict["hi"] > 3.0
    assert (verdict["seeds"], verdict["above"], verdict["below"]) == (3, 3, 0)
    assert np.isnan(seed_verdict(seeds[:1], rounds=100)["lo"])


def test_control_placement():
    """A cell at the controls' median: percentile 50, gap 0 inside its CI; a cell beyond every control: 100 (or 0)."""
    rng = np.random.default_rng(2)
    controls = rng.normal(rng.normal(0, 0.1, size=(11, 1)), 1.0, size=(11, 60))
    middle = controls[np.argsort(controls.mean(1))[5]]
    placed = control_placement(middle, controls, rounds=500)
    assert placed["percentile"] == 50 and placed["gap"] == 0 and placed["lo"] < 0 < placed["hi"] and placed["k"] == 11
    assert control_placement(middle + 5, controls, rounds=500)["percentile"] == 100
    below = control_placement(middle - 5, controls, rounds=500)
    assert below["percentile"] == 0 and below["hi"] < 0
    assert np.isnan(control_placement(middle, np.empty((0, 60)))["percentile"])


def test_a_false_positive_count_bounds_the_rate_exactly():
    from rolemrc.core.stats import rate_upper_bound, trials_for_bound

    assert trials_for_bound(0.05) == 59 and rate_upper_bound(0, 59) <= 0.05 < rate_upper_bound(0, 58)
    assert rate_upper_bound(0, 4) == pytest.approx(1 - 0.05 ** (1 / 4))    # 0 of 4 bounds it only at 53%
    assert rate_upper_bound(0, 4) == pytest.approx(0.527, abs=1e-3)
    assert rate_upper_bound(3, 3) == 1.0 and rate_upper_bound(0, 0) == 1.0
    assert rate_upper_bound(1, 100) == pytest.approx(0.0466, abs=1e-3)      # Clopper-Pearson, one-sided 95%
