"""Probe collection: exactness against an independent numpy computation, padding invariance,
backend agreement, empty dimensions, file round trip."""

import math

import numpy as np
import pytest
import torch

from rolemrc.core.chat import render_chat
from rolemrc.core.hooks import HOOK_POINTS, UnsupportedModelError, layout_of, site
from rolemrc.core.modeling import load_model
from rolemrc.core.records import prompt_turns
from rolemrc.core.taxonomy import DIMENSIONS, dimensions_for_task
from rolemrc.probe import ProbeCounts, collect


def reference_counts(model, tok, records, point, top_fraction, tokens, rank):
    """Independent path: one unpadded prompt at a time through the full model, a plain hook that
    keeps the activations, numpy top-k."""
    n_layers = len(model.model.layers) if hasattr(model, "model") else len(model.transformer.h)
    kept = {}
    handles = []
    for i in range(n_layers):
        s = site(model, point, i)
        if s.is_input:
            handles.append(s.module.register_forward_pre_hook(lambda m, a, i=i: kept.__setitem__(i, a[0][0].numpy().copy())))
        else:
            handles.append(s.module.register_forward_hook(
                lambda m, a, o, i=i: kept.__setitem__(i, (o[0] if isinstance(o, tuple) else o)[0].numpy().copy())))
    counts, obs = {}, {}
    for rec in records:
        text = render_chat(tok, prompt_turns(rec))
        ids = tok(text, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            model(**ids)
        dims = dimensions_for_task(rec["task"])
        for i in range(n_layers):
            acts = kept[i] if tokens == "all" else kept[i][-1:]
            scores = np.abs(acts) if rank == "abs" else acts
            k = math.ceil(top_fraction * scores.shape[-1])
            top = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
            active = np.zeros_like(scores, dtype=np.int64)
            np.put_along_axis(active, top, 1, axis=-1)
            for d in dims:
                counts.setdefault(d, np.zeros((n_layers, scores.shape[-1]), dtype=np.int64))[i] += active.sum(0)
        for d in dims:
            obs[d] = obs.get(d, 0) + (ids["input_ids"].shape[1] if tokens == "all" else 1)
    for h in handles:
        h.remove()
    return counts, obs


@pytest.mark.parametrize("arch,point,tokens,rank", [
    ("llama", "mlp.act", "last", "signed"),
    ("llama", "mlp.post", "all", "abs"),
    ("qwen2", "attn.out", "last", "abs"),
    ("qwen2", "resid.post", "all", "signed"),
    ("gpt2", "mlp.act", "all", "signed"),
    ("gpt2", "mlp.out", "last", "signed"),
])
def test_collect_equals_independent_numpy_computation(model_dirs, records, arch, point, tokens, rank):
    model, tok = load_model(model_dirs[arch], device="cpu")
    ref_counts, ref_obs = reference_counts(model, tok, records, point, 0.2, tokens, rank)
    got = collect(model, records, tokenizer=tok, hook=point, tokens=tokens, rank=rank, batch_size=8, progress=False)
    for d in DIMENSIONS:
        assert got.observations[d] == ref_obs[d]
        np.testing.assert_array_equal(got.count[d].numpy(), ref_counts[d])


def test_batch_size_one_and_eight_give_identical_counts(model_dirs, records):
    for arch in ("llama", "gpt2"):
        model, tok = load_model(model_dirs[arch], device="cpu")
        one = collect(model, records, tokenizer=tok, batch_size=1, tokens="all", progress=False)
        eight = collect(model, records, tokenizer=tok, batch_size=8, tokens="all", progress=False)
        for d in one.dimensions:
            assert torch.equal(one.count[d], eight.count[d]), (arch, d)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_three_backends_give_identical_counts(model_dirs, records, arch):
    results = {}
    for backend in ("torch", "nnsight", "transformer-lens"):
        model, tok = load_model(model_dirs[arch], device="cpu")
        model.set_attn_implementation("eager")  # the bridge runs eager attention; compare like with like
        for point in ("mlp.act", "mlp.post", "attn.out"):
            results[backend, point] = collect(model, records, tokenizer=tok, hook=point, backend=backend,
                                              batch_size=8, progress=False)
    for point in ("mlp.act", "mlp.post", "attn.out"):
        base = results["torch", point]
        assert sum(int(c.sum()) for c in base.count.values()) > 0
        for backend in ("nnsight", "transformer-lens"):
            other = results[backend, point]
            for d in base.dimensions:
                assert torch.equal(base.count[d], other.count[d]), (backend, point, d)


def test_every_observation_counts_exactly_k_units(model_dirs, records):
    model, tok = load_model(model_dirs["llama"], device="cpu")
    got = collect(model, records, tokenizer=tok, hook="mlp.act", top_fraction=0.2, progress=False)
    k = math.ceil(0.2 * 96)
    assert int(got.meta["k"]) == k
    for d in got.dimensions:
        assert (got.count[d].sum(1) == k * got.observations[d]).all()
        freq = got.freq(d)
        assert float(freq.min()) >= 0 and float(freq.max()) <= 1


def test_empty_dimension_is_reported_not_divided(model_dirs, records, tmp_path):
    model, tok = load_model(model_dirs["llama"], device="cpu")
    style_only = [r for r in records if dimensions_for_task(r["task"]) == ("role_style",)]
    got = collect(model, style_only, tokenizer=tok, progress=False)
    assert got.cases["role_style"] == len(style_only)
    assert set(got.empty_dimensions) == set(DIMENSIONS) - {"role_style"}
    with pytest.raises(ValueError, match="has no cases"):
        got.freq("nested")
    loaded = ProbeCounts.load(got.save(tmp_path / "p.safetensors"))
    assert loaded.cases == got.cases and loaded.empty_dimensions == got.empty_dimensions


def test_probe_file_round_trip_and_metadata(model_dirs, records, tmp_path):
    got = collect(model_dirs["qwen2"], records, hook="attn.out", device="cpu", progress=False)
    path = got.save(tmp_path / "probe.safetensors")
    loaded = ProbeCounts.load(path)
    for key in ("model", "model_fingerprint", "hook", "top_fraction", "tokens", "rank", "dtype",
                "data_fingerprint", "toolkit_version"):
        assert loaded.meta[key], key
    assert loaded.meta["hook"] == "attn.out" and loaded.meta["width"] == "64"
    for d in got.dimensions:
        assert torch.equal(loaded.count[d], got.count[d])


def test_dimension_field_and_ungrouped_records(model_dirs, records):
    model, tok = load_model(model_dirs["llama"], device="cpu")
    grouped = [{**r, "group": ["x", "y"][i % 2]} for i, r in enumerate(records[:10])]
    got = collect(model, grouped, tokenizer=tok, dimension_field="group", progress=False)
    assert got.dimensions == ["x", "y"] and got.cases == {"x": 5, "y": 5}
    untasked = [{**r, "task": "free_chat"} for r in records[:6]]
    got = collect(model, untasked, tokenizer=tok, progress=False)
    assert got.cases["all"] == 6 and all(got.cases[d] == 0 for d in DIMENSIONS)
    # plain prompt strings and chat lists: the same counts as the records they stand for
    strings = ["Who keeps the lighthouse?", "Sing to the ovens, baker."]
    for prompts, same in (([prompt_turns(r) for r in untasked], untasked),
                          (strings, [{"question": [{"role": "user", "content": s}]} for s in strings])):
        a, b = (collect(model, x, tokenizer=tok, progress=False) for x in (prompts, same))
        assert a.cases == b.cases and all(torch.equal(a.count[d], b.count[d]) for d in a.dimensions)


def test_unknown_hook_point_and_layout_errors(model_dirs, records):
    model, tok = load_model(model_dirs["llama"], device="cpu")
    with pytest.raises(ValueError, match="unknown hook point 'mlp.gate'"):
        collect(model, records, tokenizer=tok, hook="mlp.gate", progress=False)
    with pytest.raises(UnsupportedModelError, match="supported layouts: llama-like"):
        layout_of(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="unknown backend"):
        collect(model, records, tokenizer=tok, backend="jax", progress=False)
    assert set(HOOK_POINTS) == {"mlp.act", "mlp.post", "mlp.out", "attn.out", "resid.post"}


def test_mistral_layout_resolves_and_collects(tokenizer, records):
    from rolemrc.core.tiny import build_model

    model = build_model("mistral", tokenizer, hidden=64, layers=2, intermediate=96)
    assert layout_of(model).blocks == "model.layers"
    for point in HOOK_POINTS:
        got = collect(model, records[:8], tokenizer=tokenizer, hook=point, progress=False)
        assert got.meta["layers"] == "2" and sum(got.observations.values()) >= 8
