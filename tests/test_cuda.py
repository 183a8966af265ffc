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
