"""Each unit's top cases: equal to a brute-force reference (one unpadded prompt at a time, a plain hook, a full
sort); kept in the probe file, merged exactly, carried into the diff folder; the packing's order."""

import json

import pytest
import torch
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.modeling import load_model
from rolemrc.probe import collect, collect_paired, diff, load_diff, load_probe, write_diff
from rolemrc.probe.cases import build_cases
from rolemrc.probe.errors import ProbeError
from rolemrc.probe.topcases import EMPTY, TEXT_CHARS, TOP_FILE, case_text, pack, sorted_positions, unpack


@pytest.fixture(scope="module")
def llama(model_dirs):
    return load_model(model_dirs["llama"], device="cpu")


def reference_top(model, tok, records, n, tokens, rank):
    """Per unit, (values, record ids) of its n most activating cases: each case alone through the model, the
    activation of the Llama MLP's act_fn kept by a forward hook, then a full sort (value descending, then the case's
    position among the sorted case hashes)."""
    layers = model.model.layers
    kept = {}
    handles = [layer.mlp.act_fn.register_forward_hook(lambda m, a, o, i=i: kept.__setitem__(i, o[0].detach().clone()))
               for i, layer in enumerate(layers)]
    cases = build_cases(records, tok)
    per_case = []
    for ids in cases.input_ids:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
        acts = torch.stack([kept[i] for i in range(len(layers))])   # [layers, seq, width]
        acts = acts.abs() if rank == "abs" else acts
        per_case.append(acts[:, -1] if tokens == "last" else acts.amax(1))
    for h in handles:
        h.remove()
    values = torch.stack(per_case, -1)   # [layers, width, cases]
    positions = sorted_positions(cases.hashes)
    order = torch.sort(positions.expand_as(values), dim=-1, stable=True)
    by_position = values.gather(-1, order.indices)          # cases in position order
    top = torch.sort(by_position, dim=-1, descending=True, stable=True)
    case_of = order.indices.gather(-1, top.indices)[..., :n]
    ids = [[[records[c]["id"] for c in row] for row in layer] for layer in case_of.tolist()]
    return top.values[..., :n], ids


def listed_ids(top):
    return [[[top.texts[c]["id"] for c in row] for row in layer] for layer in top.cases.tolist()]


@pytest.mark.parametrize(("tokens", "rank"), [("last", "signed"), ("all", "signed"), ("last", "abs")])
def test_top_cases_equal_a_brute_force_reference(llama, records, tokens, rank):
    model, tok = llama
    want_values, want_ids = reference_top(model, tok, records[:24], 5, tokens, rank)
    one = collect(model, records[:24], tokenizer=tok, batch_size=1, tokens=tokens, rank=rank, progress=False)
    assert one.top.values.shape == (2, 96, 5) and one.top.cases.dtype == torch.int32
    assert torch.equal(one.top.values, want_values) and listed_ids(one.top) == want_ids
    batched = collect(model, records[:24], tokenizer=tok, batch_size=8, tokens=tokens, rank=rank, progress=False)
    torch.testing.assert_close(batched.top.values, want_values, rtol=1e-5, atol=1e-6)


def test_texts_dimensions_and_fewer_cases_than_n(llama, records):
    model, tok = llama
    few = [{**records[0], "question": [{"role": "user", "content": "x" * 500}]}, records[1]]
    probe = collect(model, few, tokenizer=tok, top_cases=4, progress=False)
    assert (probe.top.cases[..., 2:] == -1).all() and probe.top.values[..., 2:].isnan().all()
    assert (probe.top.cases[..., :2] >= 0).all()
    texts = sorted(probe.top.texts.values(), key=lambda t: t["id"])
    assert texts[0] == {"id": "t0", "dimensions": list(build_cases(few, tok).texts[0]["dimensions"]),
                        "text": "x" * (TEXT_CHARS - 1) + "…"}
    assert case_text([{"role": "user", "content": "short"}]) == "short"
    assert collect(model, few, tokenizer=tok, top_cases=0, progress=False).top is None
    with pytest.raises(ProbeError, match="top cases must be >= 0"):
        collect(model, few, tokenizer=tok, top_cases=-1, progress=False)


def test_packing_orders_by_value_then_position():
    values = torch.tensor([1.5, -2.0, 1.5, 0.0, -0.0, float("inf"), -1e-30, 3e38])
    positions = torch.tensor([7, 1, 2, 3, 4, 5, 6, 0])
    keys = pack(values, positions)
    order = keys.argsort(descending=True)
    assert positions[order].tolist() == [5, 0, 2, 7, 3, 4, 6, 1]
    got_values, got_positions = unpack(keys)
    assert torch.equal(got_values, values) and torch.equal(got_positions, positions.int())
    empty_values, empty_positions = unpack(torch.full((2,), EMPTY))
    assert empty_values.isnan().all() and (empty_positions == -1).all()
    assert (pack(torch.tensor([-3e38]), torch.tensor([2 ** 31 - 1])) > EMPTY).all()


def test_probe_file_paired_file_and_diff_keep_both_models_top_cases(model_dirs, records, tmp_path):
    pair = [load_model(model_dirs[arch], device="cpu") for arch in ("llama", "qwen2")]
    paired = collect_paired([m for m, _ in pair], records, tokenizers=[t for _, t in pair], progress=False)
    loaded = load_probe(paired.save(tmp_path / "paired.safetensors"))
    for m in (0, 1):
        alone = collect(pair[m][0], records, tokenizer=pair[m][1], progress=False)
        assert torch.equal(loaded.counts[m].top.cases, alone.top.cases)
        assert torch.equal(loaded.counts[m].top.values, alone.top.values)
        assert loaded.counts[m].top.texts == alone.top.texts
    result = diff(loaded)
    write_diff(result, tmp_path / "diff", figures=False)
    carried = load_diff(tmp_path / "diff").top_cases
    assert sorted(carried) == ["a", "b"] and (tmp_path / "diff" / TOP_FILE).is_file()
    for side, m in (("a", 0), ("b", 1)):
        assert torch.equal(carried[side].cases, loaded.counts[m].top.cases)
        assert carried[side].texts == loaded.counts[m].top.texts


def test_cli_top_cases_option(model_dirs, records, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records[:6]))
    for n, present in ((3, True), (0, False)):
        out = tmp_path / f"p{n}.safetensors"
        res = CliRunner().invoke(app, ["probe", "collect", "--model", str(model_dirs["llama"]), "--data", str(data),
                                       "--out", str(out), "--device", "cpu", "--top-cases", str(n)])
        assert res.exit_code == 0, res.output
        probe = load_probe(out)
        assert (probe.top is not None) == present and probe.meta["top_cases"] == str(n)
        if present:
            assert probe.top.n == 3
    res = CliRunner().invoke(app, ["probe", "collect", "--model", str(model_dirs["llama"]), "--data", str(data),
                                   "--out", str(tmp_path / "x.safetensors"), "--top-cases", "-1"])
    assert res.exit_code == 2 and "top-cases" in res.output.lower().replace("_", "-")
