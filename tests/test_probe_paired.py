"""Paired probing: one pass over several models equals separate collections (counts and activation moments);
discordant counts and per-case share sums equal a brute-force per-case computation; McNemar and the paired t-test
equal scipy; state does not grow with cases; mismatches are refused; CLI end to end."""

import json
import math

import numpy as np
import pytest
import torch
from fixtures import corpus
from scipy import stats
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.chat import render_chat
from rolemrc.core.hooks import site
from rolemrc.core.io import write_jsonl
from rolemrc.core.modeling import load_model
from rolemrc.core.records import prompt_turns
from rolemrc.core.stats import mcnemar
from rolemrc.core.taxonomy import dimensions_for_task
from rolemrc.core.tiny import build_model, train_tokenizer
from rolemrc.probe import ProbeMismatchError, collect, collect_paired, diff, load_probe
from rolemrc.probe.cases import build_cases
from rolemrc.probe.collect import CollectConfig, count_paired

SIZES = {"hidden": 64, "layers": 2, "intermediate": 96}


@pytest.fixture(scope="module")
def other_llama(tokenizer, tmp_path_factory):
    """A second llama with the shared tokenizer (different weights: plays DPO to the fixture's SFT)."""
    path = tmp_path_factory.mktemp("other-llama")
    build_model("llama", tokenizer, seed=7, **SIZES).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def loaded(model_dirs, other_llama):
    return [load_model(p, device="cpu") for p in (model_dirs["llama"], other_llama)]


def case_activity(model, tok, records, tokens, point="mlp.act", top_fraction=0.2):
    """Brute force: per case (one unpadded prompt through the full model), the share of its counted
    positions on which each unit is in the top k: [cases, layers, width] (0/1 for tokens=last)."""
    kept, handles = {}, []
    for i in range(2):
        s = site(model, point, i)
        handles.append(s.module.register_forward_hook(lambda m, a, o, i=i: kept.__setitem__(i, o[0].numpy().copy())))
    out = []
    for rec in records:
        ids = tok(render_chat(tok, prompt_turns(rec)), add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            model(**ids)
        layers = []
        for i in range(2):
            acts = kept[i] if tokens == "all" else kept[i][-1:]
            k = math.ceil(top_fraction * acts.shape[-1])
            active = np.zeros_like(acts, dtype=np.int64)
            np.put_along_axis(active, np.argsort(-acts, axis=-1, kind="stable")[:, :k], 1, axis=-1)
            layers.append(active.mean(0))
        out.append(np.stack(layers))
    for h in handles:
        h.remove()
    return np.stack(out)


def members(records, dimension):
    return np.array([dimension in dimensions_for_task(r["task"]) for r in records])


@pytest.mark.parametrize("tokens", ["last", "all"])
def test_paired_counts_equal_separate_collections(model_dirs, other_llama, records, tokens):
    paths = [model_dirs["llama"], other_llama, model_dirs["gpt2"]]  # three models: three pairs
    paired = collect_paired(paths, records, tokens=tokens, batch_size=8, device="cpu", progress=False)
    assert paired.models == [str(p) for p in paths]
    for m, path in enumerate(paths):
        alone = collect(path, records, tokens=tokens, batch_size=8, device="cpu", progress=False)
        assert paired.counts[m].meta["model_fingerprint"] == alone.meta["model_fingerprint"]
        for d in alone.dimensions:
            assert torch.equal(paired.counts[m].count[d], alone.count[d]), (m, d)
            assert paired.counts[m].observations[d] == alone.observations[d]
            for table in ("act_sum", "act_sq"):   # the same batches: the same activations, the same fixed-point sums
                assert torch.equal(getattr(paired.counts[m], table)[d], getattr(alone, table)[d]), (m, d, table)


def test_discordant_counts_equal_brute_force(loaded, records, tmp_path):
    (ma, tok), (mb, _) = loaded
    paired = collect_paired([ma, mb], records, tokenizers=[tok, tok], batch_size=8, progress=False)
    paired = load_probe(paired.save(tmp_path / "paired.safetensors"))  # through the file
    act_a, act_b = case_activity(ma, tok, records, "last"), case_activity(mb, tok, records, "last")
    for d in paired.dimensions:
        rows = members(records, d)
        b01 = (act_a[rows] * (1 - act_b[rows])).sum(0)
        b10 = (act_b[rows] * (1 - act_a[rows])).sum(0)
        np.testing.assert_array_equal(paired.discordant(0, 1, d).numpy(), b01)
        np.testing.assert_array_equal(paired.discordant(1, 0, d).numpy(), b10)
    assert int(paired.discordant(0, 1, "multi_turn").sum()) > 0
    result = diff(paired)
    assert result.test == "mcnemar"
    b01, b10 = paired.discordant(0, 1, "multi_turn"), paired.discordant(1, 0, "multi_turn")
    for layer, unit in [(0, 0), (1, 5), *torch.nonzero(b01 + b10)[:4].tolist()]:
        x, n = int(b10[layer, unit]), int(b01[layer, unit] + b10[layer, unit])
        want = stats.binomtest(x, n, 0.5).pvalue if n else 1.0
        assert float(result.pvalue["multi_turn"][layer, unit]) == pytest.approx(want, rel=1e-12)


def test_mcnemar_matches_binomtest_on_a_grid():
    b01 = torch.tensor([[0, 3, 10, 40, 7], [1, 0, 25, 500, 12]])
    b10 = torch.tensor([[0, 9, 10, 2, 0], [1, 6, 5, 470, 13]])
    stat, p = mcnemar(b01, b10)
    for i, j in np.ndindex(*b01.shape):
        n = int(b01[i, j] + b10[i, j])
        want = stats.binomtest(int(b01[i, j]), n, 0.5).pvalue if n else 1.0
        assert float(p[i, j]) == pytest.approx(want, rel=1e-12)
        assert math.copysign(1, float(stat[i, j])) == math.copysign(1, int(b01[i, j] - b10[i, j])) or n == 0


def test_tokens_all_paired_t_test_matches_ttest_rel(loaded, records):
    (ma, tok), (mb, _) = loaded
    paired = collect_paired([ma, mb], records, tokenizers=[tok, tok], tokens="all", batch_size=8, progress=False)
    share_a, share_b = case_activity(ma, tok, records, "all"), case_activity(mb, tok, records, "all")
    result = diff(paired)
    assert result.test == "paired-t"
    for d in ("multi_turn", "role_style"):
        rows = members(records, d)
        total, squares = paired.share_diff(0, 1, d)
        np.testing.assert_allclose(total.numpy(), (share_b[rows] - share_a[rows]).sum(0), atol=1e-9)
        np.testing.assert_allclose(squares.numpy(), ((share_b[rows] - share_a[rows]) ** 2).sum(0), atol=1e-9)
        assert torch.equal(paired.share_diff(1, 0, d)[0], -total)
        for layer, unit in [(0, 0), (0, 17), (1, 3), (1, 95)]:
            want = stats.ttest_rel(share_b[rows, layer, unit], share_a[rows, layer, unit])
            assert float(result.z[d][layer, unit]) == pytest.approx(want.statistic, rel=1e-6)
            assert float(result.pvalue[d][layer, unit]) == pytest.approx(want.pvalue, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("tokens", ["last", "all"])
def test_same_model_twice_gives_no_discordance_and_no_significant_units(loaded, records, tokens):
    (model, tok), _ = loaded
    paired = collect_paired([model, model], records, tokenizers=[tok, tok], tokens=tokens, progress=False)
    assert all(float(t.abs().sum()) == 0 for t in paired.pair_stats.values())
    result = diff(paired)
    for d in result.dimensions:
        assert float(result.delta[d].abs().max()) == 0 and float(result.qvalue[d].min()) == 1.0
        assert result.layer_summary()[0]["significant_units"] == 0


def test_counter_state_does_not_grow_with_cases(loaded, records, tokenizer):
    (ma, tok), (mb, _) = loaded
    config = CollectConfig(progress=False, batch_size=4)
    shapes = []
    for n in (8, 40):
        cases = build_cases(records[:n], tok, max_length=None)
        paired = count_paired([ma, mb], tok, cases, config)
        shapes.append([tuple(paired.stats.shape), *(tuple(c.count.shape) for c in paired.counters),
                       *(tuple(c.case_share().shape) for c in paired.counters)])  # the last batch only
    assert shapes[0] == shapes[1]


def test_refusals(loaded, records, model_dirs, tmp_path):
    (model, tok), _ = loaded
    other_tok = train_tokenizer(corpus(seed=3), vocab_size=300)
    stranger = build_model("llama", other_tok, seed=1, **SIZES)
    with pytest.raises(ValueError, match="do not share a tokenizer.*vocabulary differ"):
        collect_paired([model, stranger], records, tokenizers=[tok, other_tok], progress=False)
    wider = build_model("llama", tok, seed=1, hidden=64, layers=2, intermediate=128)
    with pytest.raises(ValueError, match=r"differ at mlp.act: \(layers, width\) \(2, 96\) vs \(2, 128\)"):
        collect_paired([model, wider], records, tokenizers=[tok, tok], progress=False)
    with pytest.raises(ValueError, match="two or more models"):
        collect_paired([model], records, tokenizers=[tok], progress=False)
    paired = collect_paired([model, model], records[:6], tokenizers=[tok, tok], progress=False)
    with pytest.raises(ValueError, match="no model 2 in this paired probe file"):
        diff(paired, models=(0, 2))
    single = collect(model, records[:6], tokenizer=tok, progress=False).save(tmp_path / "one.safetensors")
    with pytest.raises(ValueError, match="one model's probe file"):
        diff(single)
    for key, value in (("rank", "abs"), ("generation_prompt", False)):
        other = collect(model, records[:6], tokenizer=tok, progress=False, **{key: value})
        with pytest.raises(ProbeMismatchError, match=f"not comparable.*{key}"):
            diff(single, other)


def test_cli_paired_collect_and_diff(model_dirs, other_llama, records, tmp_path):
    data = tmp_path / "test.jsonl"
    write_jsonl(data, records)
    runner = CliRunner()

    def run(*args):
        res = runner.invoke(app, [str(a) for a in args])
        return res, (json.loads(res.stdout[res.stdout.index("{"):]) if res.exit_code == 0 else None)

    common = ("--data", data, "--batch-size", 8, "--device", "cpu")
    sft, dpo = model_dirs["llama"], other_llama
    res, report = run("probe", "collect", "--model", sft, "--model", dpo, *common, "--out", tmp_path / "p.safetensors")
    assert res.exit_code == 0, res.output
    assert report["models"] == [str(sft), str(dpo)] and report["width"] == 96
    res, summary = run("probe", "diff", tmp_path / "p.safetensors", "--out", tmp_path / "d", "--no-figures")
    assert res.exit_code == 0, res.output
    assert summary["test"] == "mcnemar" and "no_test" not in summary
    assert json.loads((tmp_path / "d" / "summary.json").read_text())["test"] == "mcnemar"
    res, flipped = run("probe", "diff", tmp_path / "p.safetensors", "--a", 1, "--b", 0, "--out", tmp_path / "d2",
                       "--no-figures")
    assert res.exit_code == 0 and flipped["dimensions"]["multi_turn"]["mean_abs_delta"] == pytest.approx(
        summary["dimensions"]["multi_turn"]["mean_abs_delta"])
    res, _ = run("probe", "diff", tmp_path / "p.safetensors", "--a", 0, "--b", 3, "--out", tmp_path / "d3")
    assert res.exit_code == 2 and "no model 3" in res.output

    for name, model in (("a", sft), ("b", dpo)):  # the old way still works, and names its test
        for tokens in ("last", "all"):
            res, _ = run("probe", "collect", "--model", model, *common, "--tokens", tokens,
                         "--out", tmp_path / f"{name}-{tokens}.safetensors")
            assert res.exit_code == 0, res.output
    res, summary = run("probe", "diff", tmp_path / "a-last.safetensors", tmp_path / "b-last.safetensors",
                       "--out", tmp_path / "u", "--no-figures")
    assert res.exit_code == 0 and summary["test"] == "two-proportion-z"
    res, summary = run("probe", "diff", tmp_path / "a-all.safetensors", tmp_path / "b-all.safetensors",
                       "--out", tmp_path / "ua", "--no-figures")
    assert res.exit_code == 0 and summary["test"] == "none" and "correlated" in summary["no_test"]
    assert all(v["significant_units"] is None for v in summary["dimensions"].values())
    units = json.loads((tmp_path / "ua" / "units.json").read_text())
    assert units and all("q" not in u and "p" not in u for u in units)
    assert "q" not in (tmp_path / "ua" / "units.csv").read_text().splitlines()[0].split(",")

    res, _ = run("probe", "collect", "--model", sft, "--model", dpo, *common, "--tokens", "all",
                 "--out", tmp_path / "pa.safetensors")
    assert res.exit_code == 0, res.output
    res, summary = run("probe", "diff", tmp_path / "pa.safetensors", "--out", tmp_path / "da", "--no-figures")
    assert res.exit_code == 0 and summary["test"] == "paired-t"

    res, _ = run("probe", "collect", "--model", sft, *common, "--rank", "abs", "--out", tmp_path / "abs.safetensors")
    res, _ = run("probe", "diff", tmp_path / "a-last.safetensors", tmp_path / "abs.safetensors", "--out", tmp_path / "x")
    assert res.exit_code == 2 and "not comparable" in res.output and "rank: 'signed' vs 'abs'" in res.output
    res, _ = run("probe", "diff", tmp_path / "p.safetensors", tmp_path / "a-last.safetensors", "--out", tmp_path / "y")
    assert res.exit_code == 2 and "paired probe file" in res.output
