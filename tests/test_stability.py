"""Stability of selections (probe/resample.py, intervene/stability.py): the case weights depend on the case alone; a
replicate of a probe IS the probe of its resample of the cases (single and paired); a planted change is selected
alike in every replicate and sampling noise near chance; `probe diff` and `intervene select` print the overlap."""

import json

import pytest
import torch
from fixtures import ANSWERABLE_UNITS, save_planted_llama
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.modeling import load_model
from rolemrc.intervene.budget import Budget
from rolemrc.intervene.stability import selection_stability
from rolemrc.probe import collect, collect_paired, diff, load_probe
from rolemrc.probe.cases import build_cases
from rolemrc.probe.resample import resample_weights, selection_overlap

TABLES = ("count", "cases", "observations", "act_sum", "act_sq")


def test_weights_are_poisson_one_and_a_function_of_the_case_alone():
    hashes = torch.randint(-2 ** 63, 2 ** 63 - 1, (20000,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    weights = resample_weights(hashes, 5)
    assert weights.shape == (5, 20000) and weights.dtype == torch.int64 and int(weights.min()) == 0
    assert abs(weights.double().mean() - 1) < 0.02 and abs(weights.double().var() - 1) < 0.04
    assert abs(float((weights == 0).double().mean()) - 0.3679) < 0.01   # P(X = 0) = 1/e
    order = torch.randperm(20000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(resample_weights(hashes[order], 5), weights[:, order])   # any order, any shard
    assert not torch.equal(weights[0], weights[1])                              # replicates differ


def test_overlap_of_known_selections():
    full = torch.tensor([1, 1, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
    reps = torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 0, 0, 0]], dtype=torch.bool)
    got = selection_overlap(full, reps)
    assert got["units"] == 2 and got["resamples"] == 3
    assert got["jaccard_mean"] == pytest.approx((1 / 3 + 0 + 0) / 3) and got["jaccard_min"] == 0
    assert got["jaccard_full"] == pytest.approx((1 + 1 / 3 + 0) / 3) and got["chance"] == pytest.approx(2 / 14)
    nothing = selection_overlap(torch.zeros(8, dtype=torch.bool), torch.zeros(3, 8, dtype=torch.bool))
    assert nothing["units"] == 0 and nothing["jaccard_mean"] is nothing["jaccard_full"] is None and nothing["chance"] == 0


def resampled(records, tokenizer, r, resamples):
    """The records each repeated w[r, case] times."""
    weights = resample_weights(build_cases(records, tokenizer).hashes, resamples)
    return [rec for rec, w in zip(records, weights[r].tolist()) for _ in range(w)]


@pytest.mark.parametrize("tokens", ["last", "all"])
def test_a_replicate_is_the_probe_of_its_resample_of_the_cases(model_dirs, records, tmp_path, tokens):
    """Single and paired: replicate r (as collected, and as saved and loaded) equals a collection over the records
    repeated w[r, case] times, tensor for tensor (one case per batch: no padding, so activations are bit-equal)."""
    models = [load_model(model_dirs[arch], device="cpu") for arch in ("llama", "qwen2")]
    tokenizer = models[0][1]
    kw = {"batch_size": 1, "progress": False, "tokens": tokens, "top_cases": 0}
    one = collect(models[0][0], records, tokenizer=tokenizer, resamples=2, **kw)
    paired = collect_paired([m for m, _ in models], records, tokenizers=[t for _, t in models], resamples=2, **kw)
    loaded = [load_probe(one.save(tmp_path / "one.safetensors")), load_probe(paired.save(tmp_path / "paired.safetensors"))]
    assert [len(x.resamples) for x in (one, paired, *loaded)] == [2] * 4
    for r in range(2):
        cases = resampled(records, tokenizer, r, 2)
        once = collect(models[0][0], cases, tokenizer=tokenizer, resamples=0, **kw)
        together = collect_paired([m for m, _ in models], cases, tokenizers=[t for _, t in models], resamples=0, **kw)
        for got in (one.resamples[r], loaded[0].resamples[r]):
            for table in TABLES:
                assert all(torch.equal(torch.as_tensor(getattr(got, table)[d]), torch.as_tensor(getattr(once, table)[d]))
                           for d in once.dimensions), table
        for got in (paired.resamples[r], loaded[1].resamples[r]):
            assert got.pair_stats.keys() == together.pair_stats.keys()
            assert all(torch.equal(got.pair_stats[k], together.pair_stats[k]) for k in together.pair_stats)
            assert all(torch.equal(got.counts[m].count[d], together.counts[m].count[d]) for m in (0, 1)
                       for d in together.dimensions)


@pytest.fixture(scope="module")
def planted_diff(tokenizer, records, tmp_path_factory):
    """A paired diff of the planted Llama with its units off (SFT) and on (DPO): 4 units carry the change."""
    root = tmp_path_factory.mktemp("planted")
    sft, dpo = (save_planted_llama(root / name, tokenizer, units_on=on, noise=1e-3) for name, on in (("sft", False), ("dpo", True)))
    probe = collect_paired([sft, dpo], records, device="cpu", progress=False, top_cases=0)
    return diff(probe.save(root / "paired.safetensors")).save(root / "diff")


def test_a_planted_change_is_selected_in_every_replicate_and_noise_near_chance(planted_diff, model_dirs, records):
    [row] = selection_stability(planted_diff, "role_style", "frequency", [Budget("top_k", len(ANSWERABLE_UNITS))])
    assert row["units"] == 4 and row["resamples"] == 5
    assert row["jaccard_mean"] == row["jaccard_min"] == row["jaccard_full"] == 1.0, row
    assert row["chance"] == pytest.approx(4 / (2 * 64 - 4))
    # one model, two disjoint halves of the cases: every difference is sampling noise
    model, tokenizer = load_model(model_dirs["llama"], device="cpu")
    halves = [collect(model, part, tokenizer=tokenizer, progress=False, top_cases=0) for part in (records[::2], records[1::2])]
    noise = diff(*halves)
    [row] = selection_stability(noise, "role_style", "standardized", [Budget("per_layer", 16)])
    assert row["units"] == 32 and row["jaccard_mean"] < row["chance"] + 0.15, row
    assert selection_stability(diff(*(collect(model, part, tokenizer=tokenizer, progress=False, top_cases=0, resamples=0)
                                      for part in (records[:4], records[4:8]))), "role_style", "frequency") == []


def test_cli_prints_the_stability(planted_diff, tmp_path):
    res = CliRunner().invoke(app, ["intervene", "select", "--diff", str(planted_diff), "--dimension", "role_style", "--method",
                                   "frequency", "--factor", "0", "--top-k", "4", "--out", str(tmp_path / "r.yaml")])
    assert res.exit_code == 0, res.output
    printed = json.loads(res.stdout.strip().splitlines()[-1])
    assert printed["stability"]["jaccard_mean"] == 1.0 and printed["stability"]["budget"] == "top-4"
    assert "jaccard mean" in res.stderr and "top-4" in res.stderr
    res = CliRunner().invoke(app, ["probe", "diff", str(planted_diff.parent / "paired.safetensors"), "--out",
                                   str(tmp_path / "diff"), "--no-figures"])
    assert res.exit_code == 0, res.output
    assert "stability over 5 resamples of the cases" in res.stderr and "256/layer" in res.stderr
    summary = json.loads((tmp_path / "diff" / "summary.json").read_text())
    assert {(r["method"], r["budget"]) for r in summary["stability"] if r["dimension"] == "role_style"} == {
        (m, f"{k}/layer") for m in ("frequency", "standardized") for k in (16, 64, 256)}
