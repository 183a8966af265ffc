"""Probe diff: statistics against scipy, refusal of mismatched files, outputs and CLI."""

import json
import math

import numpy as np
import pytest
import torch
from scipy import stats
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.stats import benjamini_hochberg, two_proportion_test
from rolemrc.core.tiny import build_model
from rolemrc.probe import ProbeCounts, ProbeMismatchError, collect, diff, load_diff, write_diff
from rolemrc.probe.diff import top_set_jaccard
from rolemrc.probe.ranking import first_per_group, rank_units


def synthetic(counts: dict, obs: dict, **meta) -> ProbeCounts:
    """Counts of `obs` cases per dimension, every activation 0 (moments of zeros)."""
    base = {"hook": "mlp.act", "width": "6", "layers": "2", "top_fraction": "0.5", "tokens": "last", "k": "3",
            "rank": "signed", "generation_prompt": "true", "model": "m"}
    count = {d: torch.tensor(c) for d, c in counts.items()}
    zeros = {d: torch.zeros(2, *c.shape, dtype=torch.int64) for d, c in count.items()}
    return ProbeCounts(count, dict(obs), dict(obs), torch.arange(max(obs.values())), zeros, dict(zeros), {**base, **meta})


def test_two_proportion_test_matches_textbook_formula():
    ca, cb = torch.tensor([10, 40, 0, 25]), torch.tensor([30, 40, 0, 5])
    z, p = two_proportion_test(ca, 50, cb, 60)
    for i in range(4):
        pa, pb = ca[i].item() / 50, cb[i].item() / 60
        pool = (ca[i].item() + cb[i].item()) / 110
        se = math.sqrt(pool * (1 - pool) * (1 / 50 + 1 / 60))
        expected_z = 0.0 if se == 0 else (pb - pa) / se
        assert z[i].item() == pytest.approx(expected_z)
        assert p[i].item() == pytest.approx(2 * stats.norm.sf(abs(expected_z)))
    assert p[2].item() == 1.0  # never active in either: no evidence of change


def test_benjamini_hochberg_matches_scipy():
    rng = np.random.default_rng(0)
    p = np.concatenate([rng.uniform(0, 1, 300), rng.uniform(0, 1e-4, 20)])
    q = benjamini_hochberg(torch.tensor(p).reshape(16, 20)).reshape(-1).numpy()
    np.testing.assert_allclose(q, stats.false_discovery_control(p, method="bh"), rtol=1e-12)


def test_top_set_jaccard():
    a = torch.tensor([[0.9, 0.8, 0.1, 0.0], [0.9, 0.8, 0.1, 0.0]])
    b = torch.tensor([[0.9, 0.8, 0.1, 0.0], [0.0, 0.1, 0.8, 0.9]])
    assert top_set_jaccard(a, b, 2).tolist() == [1.0, 0.0]


def test_diff_of_known_counts():
    a = synthetic({"multi_turn": [[50, 0, 25, 25, 0, 0], [25, 25, 25, 25, 0, 0]], "nested": [[0] * 6, [0] * 6]},
                  {"multi_turn": 50, "nested": 0})
    b = synthetic({"multi_turn": [[0, 50, 25, 25, 0, 0], [25, 25, 25, 25, 0, 0]], "nested": [[0] * 6, [0] * 6]},
                  {"multi_turn": 50, "nested": 0})
    result = diff(a, b)
    assert result.dimensions == ["multi_turn"]
    assert result.empty == {"nested": "no cases in a and b"}
    delta = result.delta["multi_turn"]
    assert delta[0, :2].tolist() == [-1.0, 1.0] and delta[1].abs().sum() == 0
    assert result.qvalue["multi_turn"][0, 0] < 1e-10 and result.qvalue["multi_turn"][1, 0] == 1.0
    assert (result.test, result.effect_test) == ("two-proportion-z", "welch-t")
    summary = result.summary()
    assert (summary["test_label"], summary["effect_test_label"]) == ("pooled two-proportion z-test", "Welch's t-test")
    top = result.ranked_units(top_n=2)
    assert {(r["layer"], r["unit"]) for r in top} == {(0, 0), (0, 1)}
    rows = result.layer_summary()
    assert rows[0]["significant_units"] == 2 and rows[1]["significant_units"] == 0
    assert rows[0]["mean_abs_delta"] == pytest.approx(2 / 6)


@pytest.mark.parametrize("field,value", [("hook", "attn.out"), ("width", "8"), ("layers", "3"),
                                         ("top_fraction", "0.1"), ("tokens", "all"), ("rank", "abs"),
                                         ("generation_prompt", "false")])
def test_mismatched_probe_files_are_refused(field, value):
    a = synthetic({"x": [[1] * 6, [1] * 6]}, {"x": 2})
    b = synthetic({"x": [[1] * 6, [1] * 6]}, {"x": 2}, **{field: value})
    with pytest.raises(ProbeMismatchError, match=f"not comparable.*{field}"):
        diff(a, b)


def test_diff_of_sft_vs_changed_model_writes_everything(model_dirs, records, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("ROLEMRC_PNG", "1")
    a = collect(model_dirs["llama"], records, device="cpu", progress=False).save(tmp_path / "a.safetensors")
    other = tmp_path / "other"
    build_model("llama", tokenizer, seed=7, hidden=64, layers=2, intermediate=96).save_pretrained(other)
    tokenizer.save_pretrained(other)
    b = collect(other, records, device="cpu", progress=False).save(tmp_path / "b.safetensors")
    summary = write_diff(diff(a, b), tmp_path / "diff", top_n=20)
    out = tmp_path / "diff"
    for name in ("diff.safetensors", "units.csv", "units.json", "layers.json", "summary.json",
                 "heatmap_layers_dimensions.html", "plotly.min.js"):
        assert (out / name).is_file(), name
    for d in ("knowledge_boundary", "role_style", "multi_turn", "nested", "prioritized"):
        assert (out / f"heatmap_units_{d}.html").is_file()
    assert summary["largest_shift"] in summary["dimensions"]
    in_memory = diff(a, b)   # the summary with its defaults, from the object
    assert in_memory.largest_shift() == in_memory.summary()["largest_shift"] == summary["largest_shift"]
    assert in_memory.summary()["dimensions"] == json.loads((out / "summary.json").read_text())["dimensions"]
    units = json.loads((out / "units.json").read_text())
    assert len(units) == 5 * 20 and all(0 <= u["q"] <= 1 for u in units)
    reloaded = load_diff(out)
    assert reloaded.hook == "mlp.act" and reloaded.meta["a_model_fingerprint"] != reloaded.meta["b_model_fingerprint"]
    assert torch.allclose(reloaded.delta["multi_turn"], reloaded.freq_b["multi_turn"] - reloaded.freq_a["multi_turn"])
    if "png_error" not in summary["figures"]["layers_x_dimensions"]:
        assert (out / "heatmap_layers_dimensions.png").stat().st_size > 10_000
    identical = diff(a, a)
    assert all(float(identical.delta[d].abs().max()) == 0 for d in identical.dimensions)


def test_cli_collect_and_diff(model_dirs, records, tmp_path):
    from rolemrc.core.io import write_jsonl

    data = tmp_path / "test.jsonl"
    write_jsonl(data, records)
    runner = CliRunner()
    for name, hook in (("a", "mlp.act"), ("b", "mlp.act"), ("c", "attn.out")):
        res = runner.invoke(app, ["probe", "collect", "--model", str(model_dirs["gpt2"]), "--data", str(data),
                                  "--hook", hook, "--batch-size", "4", "--device", "cpu",
                                  "--out", str(tmp_path / f"{name}.safetensors")])
        assert res.exit_code == 0, res.output
    report = json.loads(res.output[res.output.index("{"):])
    assert report["hook"] == "attn.out" and report["width"] == 64
    res = runner.invoke(app, ["probe", "diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"),
                              "--out", str(tmp_path / "d"), "--no-figures"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["probe", "diff", str(tmp_path / "a.safetensors"), str(tmp_path / "c.safetensors"),
                              "--out", str(tmp_path / "e")])
    assert res.exit_code == 2 and "not comparable" in res.output and "hook" in res.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "question": [{"role": "user", "content": "hi"}], "task": "x"}\n{oops\n')
    res = runner.invoke(app, ["probe", "collect", "--model", str(model_dirs["gpt2"]), "--data", str(bad),
                              "--out", str(tmp_path / "x.safetensors")])
    assert res.exit_code == 2 and "bad.jsonl:2" in res.output
    res = runner.invoke(app, ["probe", "diff", str(tmp_path / "a.safetensors"), str(tmp_path / "nope.safetensors"),
                              "--out", str(tmp_path / "f")])
    assert res.exit_code == 2 and "nope.safetensors: no such file or folder; expected a probe file" in res.output
    res = runner.invoke(app, ["probe", "collect", "--model", str(tmp_path / "nomodel"), "--data", str(data),
                              "--hook", "mlp.nope", "--out", str(tmp_path / "y.safetensors")])
    assert res.exit_code == 2 and "'--hook': 'mlp.nope' is not one of" in res.output


def test_a_diff_of_the_first_format_is_refused_with_both_formats(tmp_path):
    """Format 1 named its tests in prose (`test`: "two-proportion z-test (unpaired)"); format 2 by code."""
    from fixtures import write_diff_file
    from safetensors import safe_open
    from safetensors.torch import save_file

    file = write_diff_file(tmp_path / "d", torch.ones(2, 6), torch.full((2, 6), 0.01)) / "diff.safetensors"
    with safe_open(str(file), "pt") as fh:
        meta, tensors = fh.metadata(), {name: fh.get_tensor(name) for name in fh.keys()}  # noqa: SIM118
    save_file(tensors, str(file), metadata={**meta, "format": "1", "test": "two-proportion z-test (unpaired)"})
    for args in (["probe", "explore", "--diff", str(tmp_path / "d")],
                 ["intervene", "select", "--diff", str(file), "--dimension", "multi_turn", "--method", "frequency",
                  "--top-k", "2", "--factor", "0"]):
        res = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "out")])
        errors = [line for line in res.output.splitlines() if line.startswith("error:")]
        assert res.exit_code == 2 and len(errors) == 1, res.output
        assert (f"{file}: diff folder format 1, written by an earlier rolemrc; this one reads format 2 (rerun "
                "`rolemrc probe diff` to write it again)") in errors[0]
    assert not (tmp_path / "out").exists()


def test_rank_units_is_one_lexicographic_order():
    """|delta| descending, q ascending (NaN after every q), then layer, then unit: Python's sort on that key."""
    gen = torch.Generator().manual_seed(0)
    for layers, width in ((1, 1), (3, 7), (5, 16)):
        delta = torch.tensor([-0.5, -0.25, -0.0, 0.0, 0.25, 0.5])[torch.randint(0, 6, (layers, width), generator=gen)]
        q = torch.tensor([1e-9, 0.01, 0.5, math.nan])[torch.randint(0, 4, (layers, width), generator=gen)]
        rows = [(-abs(d), math.inf if math.isnan(p) else p, f) for f, (d, p) in enumerate(zip(delta.view(-1).tolist(), q.view(-1).tolist()))]
        assert rank_units(delta, q).tolist() == [f for *_, f in sorted(rows)]
    group = torch.tensor([0, 1, 0, 1, 0, 0])
    assert first_per_group(torch.tensor([5, 4, 3, 2, 1, 0]), group, 2).tolist() == [True, True, True, False, True, False]
