"""GPU paths (skipped without CUDA): collection on the model's device agrees with CPU and across
backends; restraints hook and bake alike on the GPU. Run on a CUDA machine with `pytest tests/test_cuda.py`."""

import pytest
import torch

from rolemrc.core.modeling import load_model
from rolemrc.intervene import Restraint, applied, bake, check
from rolemrc.probe import collect

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def agreement(a, b) -> float:
    """Share of equal counts over all dimensions, layers and units of two probe results."""
    assert a.dimensions == b.dimensions
    return torch.cat([(a.count[d] == b.count[d]).flatten() for d in a.dimensions]).float().mean().item()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("point", ["mlp.act", "mlp.out", "attn.out", "resid.post"])
def test_cuda_counts_match_cpu_and_backends(model_dirs, records, arch, point):
    cpu = collect(model_dirs[arch], records, hook=point, device="cpu", progress=False)
    gpu = {b: collect(model_dirs[arch], records, hook=point, device="cuda", backend=b, progress=False)
           for b in ("torch", "nnsight", "transformer-lens")}
    assert agreement(gpu["torch"], gpu["nnsight"]) == 1.0  # same modules, same kernels: bit-identical
    # float rounding differs between CPU and GPU kernels (and eager vs SDPA attention): a unit at the
    # top-20% boundary may flip, nothing more
    assert agreement(gpu["torch"], cpu) > 0.97
    assert agreement(gpu["torch"], gpu["transformer-lens"]) > 0.97
    assert gpu["torch"].cases == cpu.cases and gpu["torch"].observations == cpu.observations


def test_cuda_resamples_match_cpu(model_dirs, records):
    """The Poisson bootstrap replicates are counted on the model's device with the same weights as on the CPU (they
    depend on each case's hash alone): each resample's cases are equal, its counts agree as the full sample's do."""
    cpu = collect(model_dirs["llama"], records, device="cpu", progress=False, resamples=5)
    gpu = collect(model_dirs["llama"], records, device="cuda", progress=False, resamples=5)
    assert len(gpu.resamples) == len(cpu.resamples) == 5
    for a, b in zip(gpu.resamples, cpu.resamples):
        assert a.cases == b.cases and a.observations == b.observations
        assert agreement(a, b) > 0.97


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_cuda_hook_equals_bake(model_dirs, records, arch, tmp_path):
    model, tok = load_model(model_dirs[arch], device="cuda")
    n = model.config.num_hidden_layers if hasattr(model.config, "num_hidden_layers") else model.config.n_layer
    r = Restraint(name="gpu", hook="mlp.act", units={layer: list(range(0, 40, 3)) for layer in range(n)}, factor=0.0)
    bake(model_dirs[arch], r, tmp_path / "baked")
    baked, _ = load_model(tmp_path / "baked", device="cuda")
    ids = tok(["hello there, who are you?"], return_tensors="pt").to("cuda")
    with torch.inference_mode():
        before = model(**ids).logits
        with applied(model, r):
            hooked = model(**ids).logits
        after = model(**ids).logits
        from_weights = baked(**ids).logits
    assert torch.equal(before, after)
    assert (hooked - before).abs().max() > 1e-3
    assert torch.allclose(hooked, from_weights, atol=1e-4, rtol=1e-4)
    report = check(model_dirs[arch], r, baked_dir=tmp_path / "baked", device="cuda")
    assert not report.numerical_noop and report.baked_vs_hook_max_abs < 1e-4


@pytest.fixture(scope="module")
def bf16_dir(tokenizer, tmp_path_factory):
    """A Llama checkpoint saved in bf16 (config.json says so): what `--dtype auto` reads as bf16."""
    from rolemrc.core.tiny import build_model

    path = tmp_path_factory.mktemp("bf16")
    build_model("llama", tokenizer, seed=4, hidden=64, layers=2, intermediate=96).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_cuda_bf16_collect_at_auto(bf16_dir, records):
    gpu = collect(bf16_dir, records, device="cuda", progress=False)   # dtype auto: the checkpoint's bf16
    cpu = collect(bf16_dir, records, device="cpu", progress=False)
    assert gpu.meta["dtype"] == cpu.meta["dtype"] == "bfloat16"
    assert agreement(gpu, cpu) > 0.9 and gpu.cases == cpu.cases


def test_cuda_bf16_attribute_with_auto_batch(bf16_dir, model_dirs, tokenizer):
    """--batch-size auto on the GPU sizes from free memory (several pairs fit a tiny model), records the peak memory,
    and gives the numbers of one pair per batch."""
    from rolemrc.probe import attribute

    pairs = [{"id": f"p{i}", "prompt": f"Question {i}: who keeps the lighthouse?", "chosen": "I do, friend." * (i % 3 + 1),
              "rejected": "No one.", "task": "role_style"} for i in range(8)]
    auto = attribute([bf16_dir, bf16_dir], pairs, device="cuda", progress=False)
    assert int(auto.meta["batch_size"]) >= 8 and float(auto.meta["peak_memory_gib"]) > 0
    assert all(bool((s == 0).all()) for s in auto.sums.values())   # a model against itself: every unit exactly 0
    other = attribute([model_dirs["llama"], model_dirs["llama"]], pairs, device="cuda", dtype="bfloat16", progress=False)
    one = attribute([model_dirs["llama"], model_dirs["llama"]], pairs, device="cuda", dtype="bfloat16", batch_size=1,
                    progress=False)
    assert other.meta["batch_size"] != "1" and all(torch.equal(other.sums[d], one.sums[d]) for d in one.sums)


def test_cuda_bake_writes_bf16_and_check_runs_at_bf16(bf16_dir, tmp_path):
    import json

    r = Restraint(name="gpu", hook="mlp.act", units={0: [1, 2, 3], 1: [5]}, factor=0.5)
    report = bake(bf16_dir, r, tmp_path / "baked", device="cuda")   # dtype auto
    assert report.dtype == "bfloat16" and json.loads((tmp_path / "baked" / "config.json").read_text())["dtype"] == "bfloat16"
    assert next(load_model(tmp_path / "baked", device="cpu")[0].parameters()).dtype == torch.bfloat16
    checked = check(bf16_dir, r, baked_dir=tmp_path / "baked", device="cuda")
    assert checked.dtype == "bfloat16" and not checked.numerical_noop and checked.baked_vs_hook_max_rel < 0.05


def test_cuda_hub_cache_id(model_dirs, records, tmp_path, monkeypatch):
    from fixtures import cache_snapshot

    cache_snapshot(tmp_path / "hub", "org/tiny", model_dirs["llama"], "c" * 40)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    counts = collect("org/tiny", records, progress=False)   # device auto: the GPU
    assert counts.meta["model"] == "org/tiny" and counts.meta["model_dir"].endswith("c" * 40)
    model, _ = load_model("org/tiny")
    assert next(model.parameters()).device.type == "cuda"


def _run_engine(model, tok, prompts, params, restraints=None, **options):
    from rolemrc.generate.engine import Engine, Request

    engine = Engine(model, tok, **options)
    requests = [Request(p, params, params.max_tokens, lambda o: None, r, text=False)
                for p, r in zip(prompts, restraints or [None] * len(prompts))]
    with torch.inference_mode():
        for r in requests:
            engine.add(r)
        while engine.has_work():
            engine.step()
    return engine, [r.out for r in requests]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_engine_graphs_equal_eager_and_restraints_mix(peaked_model, dtype):
    """The decode step replayed as CUDA graphs gives the tokens eager decoding gives (greedy, a model with clear
    margins), also with rows under different restraints in one batch, each equal to its restraint alone."""
    from rolemrc.core.chat import render_chat
    from rolemrc.generate.params import SamplingParams

    model, tok = load_model(peaked_model, device="cuda", dtype=dtype)
    prompts = [tok(render_chat(tok, [{"role": "user", "content": f"the keeper {'of the light ' * k}"}]),
                   add_special_tokens=False)["input_ids"] for k in range(10)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    graphed, tokens = _run_engine(model, tok, prompts, params, max_batch=4)
    assert graphed.graphs is not None and graphed.graphs.graphs and not graphed.graphs.broken
    assert len(graphed.graphs.graphs) <= graphed.graphs.max_graphs
    assert _run_engine(model, tok, prompts, params, max_batch=4, graphs=False)[1] == tokens
    a = Restraint(name="a", hook="mlp.act", factor=0.0, units={0: list(range(0, 96, 2))})
    b = Restraint(name="b", hook="mlp.act", factor=0.0, units={1: list(range(1, 96, 2))})
    rows = [a, None, b, a, None, b, a, None, b, None]
    mixed = _run_engine(model, tok, prompts, params, rows, max_batch=4)[1]
    for r in (a, b):
        alone = _run_engine(model, tok, prompts, params, [r] * len(prompts), max_batch=4)[1]
        assert [m for m, x in zip(mixed, rows) if x is r] == [t for t, x in zip(alone, rows) if x is r]
    assert [m for m, x in zip(mixed, rows) if x is None] == [t for t, x in zip(tokens, rows) if x is None]
    assert mixed != tokens
