"""Activation moments in probe files: the streamed fixed-point sums equal a float64 computation on the same cases within
the rounding; the standardized effect's tests (paired t on per-case differences, Welch's t from moments) equal scipy;
files without moments still load, diff and merge; an overflow is refused."""

import json

import numpy as np
import pytest
import torch
from scipy import stats
from test_probe_paired import members

from rolemrc.core.chat import render_chat
from rolemrc.core.hooks import site
from rolemrc.core.modeling import load_model
from rolemrc.core.records import prompt_turns
from rolemrc.core.stats import welch_t_test
from rolemrc.core.tiny import build_model
from rolemrc.probe import collect, collect_paired, diff, load_probe, write_diff
from rolemrc.probe.counts import MOMENT_UNIT, TopKCounter, fixed_point, fixed_value
from rolemrc.probe.errors import ProbeError

U = MOMENT_UNIT
FLOAT_NOISE = 1e-6  # relative: a batched, padded forward's activations vs one unpadded prompt's (float32)


@pytest.fixture(scope="module")
def pair(model_dirs, tokenizer, tmp_path_factory):
    """The fixture's llama (SFT) and a llama with other weights (DPO), loaded."""
    other = tmp_path_factory.mktemp("dpo-llama")
    build_model("llama", tokenizer, seed=7, hidden=64, layers=2, intermediate=96).save_pretrained(other)
    tokenizer.save_pretrained(other)
    return [load_model(p, device="cpu") for p in (model_dirs["llama"], other)]


def case_acts(model, tok, records, tokens):
    """Brute force: per case (one unpadded prompt through the full model), its counted positions' mlp.act
    activations as float64 [layers, positions, width] (positions: the last prompt token, or all of them)."""
    kept, handles = {}, []
    for i in range(2):
        handles.append(site(model, "mlp.act", i).module.register_forward_hook(
            lambda m, a, o, i=i: kept.__setitem__(i, o[0].double().numpy().copy())))
    out = []
    for rec in records:
        ids = tok(render_chat(tok, prompt_turns(rec)), add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            model(**ids)
        out.append(np.stack([kept[i] if tokens == "all" else kept[i][-1:] for i in range(2)]))
    for h in handles:
        h.remove()
    return out


def observations(acts, records, dimension):
    """[layers, observations, width]: every counted position of the dimension's cases."""
    return np.concatenate([a for a, m in zip(acts, members(records, dimension)) if m], axis=1)


@pytest.mark.parametrize("tokens", ["last", "all"])
def test_moments_equal_a_float64_computation(pair, records, tokens):
    (model, tok), _ = pair
    acts = case_acts(model, tok, records, tokens)
    for batch_size in (1, 8):   # one case per batch: the brute force's own activations; 8: padded batches
        probe = collect(model, records, tokenizer=tok, tokens=tokens, batch_size=batch_size, progress=False)
        for d in probe.dimensions:
            x = observations(acts, records, d)
            n = x.shape[1]
            assert n == probe.observations[d]
            for got, want in ((probe.act_sum[d], x.sum(1)), (probe.act_sq[d], (x * x).sum(1))):
                noise = 0 if batch_size == 1 else FLOAT_NOISE * np.abs(want).max()
                assert got.dtype == torch.int64
                np.testing.assert_allclose(fixed_value(got).numpy(), want, rtol=0, atol=n * U / 2 + noise + 1e-12)
            mean, var = probe.moments(d)
            np.testing.assert_allclose(mean.numpy(), x.mean(1), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(var.numpy(), x.var(1, ddof=1), rtol=1e-4, atol=1e-6)
    assert float(fixed_value(probe.act_sq["multi_turn"]).min()) > 0


@pytest.mark.parametrize("tokens", ["last", "all"])
def test_paired_effect_is_a_paired_t_on_per_case_differences(pair, records, tokens, tmp_path):
    (ma, tok), (mb, _) = pair
    paired = collect_paired([ma, mb], records, tokenizers=[tok, tok], tokens=tokens, batch_size=8, progress=False)
    paired = load_probe(paired.save(tmp_path / "paired.safetensors"))   # through the file
    acts_a, acts_b = case_acts(ma, tok, records, tokens), case_acts(mb, tok, records, tokens)
    result = diff(paired)
    assert result.effect_test == "paired-t" and result.effect_tested
    for d in ("multi_turn", "role_style"):
        rows = members(records, d)
        case_a = np.stack([a.mean(1) for a, m in zip(acts_a, rows) if m])   # per case: mean over its positions
        case_b = np.stack([b.mean(1) for b, m in zip(acts_b, rows) if m])
        d_case = case_b - case_a
        total, squares = paired.act_diff(0, 1, d)
        atol = len(d_case) * (U / 2 + FLOAT_NOISE * np.abs(case_a).max())
        np.testing.assert_allclose(total.numpy(), d_case.sum(0), rtol=0, atol=atol)
        np.testing.assert_allclose(squares.numpy(), (d_case ** 2).sum(0), rtol=1e-5, atol=atol)
        assert torch.equal(paired.act_diff(1, 0, d)[0], -total)
        want = stats.ttest_rel(case_b, case_a, axis=0)
        np.testing.assert_allclose(result.effect_t[d].numpy(), want.statistic, rtol=1e-4)
        np.testing.assert_allclose(result.effect_p[d].numpy(), want.pvalue, rtol=1e-3, atol=1e-12)
        xa, xb = observations(acts_a, records, d), observations(acts_b, records, d)
        pooled = np.sqrt((xa.var(1, ddof=1) + xb.var(1, ddof=1)) / 2)
        np.testing.assert_allclose(result.effect[d].numpy(), (xb.mean(1) - xa.mean(1)) / pooled, rtol=1e-4, atol=1e-5)
        assert float(result.effect_q[d].min()) < 0.05   # different weights: some units differ
    same = diff(collect_paired([ma, ma], records, tokenizers=[tok, tok], tokens=tokens, progress=False))
    assert all(float(same.effect[d].abs().max()) == 0 and float(same.effect_q[d].min()) == 1 for d in same.dimensions)


def test_unpaired_last_token_effect_is_welch_from_moments(pair, records, tmp_path):
    (ma, tok), (mb, _) = pair
    a = collect(ma, records, tokenizer=tok, progress=False).save(tmp_path / "a.safetensors")
    b = collect(mb, records, tokenizer=tok, progress=False).save(tmp_path / "b.safetensors")
    result = diff(a, b)
    assert result.effect_test == "welch-t"
    acts_a, acts_b = case_acts(ma, tok, records, "last"), case_acts(mb, tok, records, "last")
    for d in ("multi_turn", "nested"):
        xa, xb = observations(acts_a, records, d), observations(acts_b, records, d)
        want = stats.ttest_ind(xb, xa, axis=1, equal_var=False)
        np.testing.assert_allclose(result.effect_t[d].numpy(), want.statistic, rtol=1e-4)
        np.testing.assert_allclose(result.effect_p[d].numpy(), want.pvalue, rtol=1e-3, atol=1e-12)
        assert torch.equal(result.effect_q[d], result.effect_q[d].clamp(0, 1)) and float(result.effect_q[d].min()) < 0.05
    summary = write_diff(result, tmp_path / "d", top_n=5, figures=False)
    assert summary["effect_test"] == "welch-t" and summary["dimensions"]["multi_turn"]["significant_effect_units"] > 0
    units = json.loads((tmp_path / "d" / "units.json").read_text())
    assert {"freq_a", "delta", "q", "mean_a", "mean_b", "effect", "effect_t", "effect_p", "effect_q"} <= set(units[0])
    reloaded = json.loads((tmp_path / "d" / "summary.json").read_text())
    assert reloaded["effect_test"] == "welch-t"


def test_unpaired_all_tokens_effect_has_no_test(pair, records, tmp_path):
    (ma, tok), (mb, _) = pair
    a, b = (collect(m, records[:20], tokenizer=tok, tokens="all", progress=False) for m in (ma, mb))
    result = diff(a, b)
    assert result.effect_test == "none" and not result.effect_tested
    assert all(bool(torch.isnan(result.effect_q[d]).all()) and float(result.effect[d].abs().max()) > 0 for d in result.dimensions)
    summary = write_diff(result, tmp_path / "d", top_n=5, figures=False)
    assert all(v["significant_effect_units"] is None for v in summary["dimensions"].values())
    units = json.loads((tmp_path / "d" / "units.json").read_text())
    assert "effect" in units[0] and "effect_q" not in units[0] and "q" not in units[0]


def test_welch_t_test_matches_scipy_from_stats():
    mean_a, mean_b = torch.tensor([0.0, 1.0, 2.0, 3.0, 3.0, 1.5]), torch.tensor([0.5, 1.0, 2.5, 3.0, 4.0, 1.0])
    var_a, var_b = torch.tensor([1.0, 0.2, 0.0, 0.0, 0.0, 2.0]), torch.tensor([2.0, 0.3, 0.5, 0.0, 0.0, 0.01])
    t, p = welch_t_test(mean_a, var_a, 12, mean_b, var_b, 30)
    for i in range(3):
        want = stats.ttest_ind_from_stats(float(mean_b[i]), float(var_b[i]) ** 0.5, 30, float(mean_a[i]),
                                          float(var_a[i]) ** 0.5, 12, equal_var=False)
        assert float(t[i]) == pytest.approx(want.statistic, rel=1e-12) and float(p[i]) == pytest.approx(want.pvalue, rel=1e-10)
    assert (float(t[3]), float(p[3])) == (0.0, 1.0) and (float(t[4]), float(p[4])) == (float("inf"), 0.0)
    assert welch_t_test(mean_a, var_a, 1, mean_b, var_b, 30)[1].tolist() == [1.0] * 6


def test_fixed_point_limbs_are_exact_in_any_order_and_activations_out_of_range_are_refused():
    x = torch.tensor([0.3, -0.3, -2.5, 1e-12, 16383.9999, -16383.9999]).double()
    limbs = fixed_point(x)
    assert torch.equal(limbs, limbs.round()) and bool((limbs[1] >= 0).all()) and bool((limbs[1] <= 2 ** 32).all())
    np.testing.assert_allclose(fixed_value(limbs).numpy(), x.numpy(), rtol=0, atol=U / 2)
    sums = [fixed_point(x[p]).sum(1) for p in (torch.arange(6), torch.tensor([5, 2, 0, 4, 1, 3]))]
    assert torch.equal(*sums) and abs(float(fixed_value(sums[0])) - float(x.sum())) <= 3 * U
    counter = TopKCounter(["x"], 1, 4, 1)
    counter.start_batch(torch.ones(2, 1), torch.ones(2, 3))
    counter.add(0, torch.tensor([[[0.0, 1.0, 2.0, 3.0]] * 3, [[0.0, 1.0, 2.0, -20000.0]] * 3]))
    counter.finish_batch()
    with pytest.raises(ProbeError, match="an activation of magnitude 2e\\+04 .* hold \\|x\\| < 16384"):
        counter.check_moments()
