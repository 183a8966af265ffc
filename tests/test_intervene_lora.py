"""Restraints as LoRA adapters: real PEFT on the export equals the runtime hook and the bake; refusals; CLI."""

import json
import warnings

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.modeling import dir_fingerprint
from rolemrc.core.tiny import build_model
from rolemrc.intervene import Restraint, RestraintError, applied, bake, export_lora

TEXTS = ["the keeper of the lighthouse watched storms", "sing to the ovens"]
UNITS = {0: [1, 5, 7], 1: [0, 2, 30, 41]}


@pytest.fixture(scope="module")
def dirs(model_dirs, tokenizer, tmp_path_factory):
    """arch -> tiny model directory: the session's llama, qwen2 and gpt2, and a mistral built here."""
    path = tmp_path_factory.mktemp("tiny-mistral")
    build_model("mistral", tokenizer, seed=3, hidden=64, layers=2, intermediate=96).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return {**model_dirs, "mistral": path}


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def logits(model, tokenizer):
    tokenizer.padding_side = "right"
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**batch).logits[batch["attention_mask"].bool()]


def peft(model, adapter):
    """PeftModel on an exported adapter, any warning an error (peft warns on keys of adapter_config.json it does not
    know) but transformers' own deprecations, which peft's calls raise."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
        return PeftModel.from_pretrained(model, adapter).eval()


def spec(hook, factor=0.5):
    return Restraint(name="t", hook=hook, factor=factor, units=UNITS)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("hook", ["mlp.act", "mlp.post", "mlp.out", "attn.out"])
def test_lora_equals_hook_equals_bake(dirs, tokenizer, tmp_path, arch, hook):
    for factor in (0.0, 0.5, 1 - 1e-6, 1.5):
        r = spec(hook, factor)
        export_lora(dirs[arch], r, tmp_path / "lora")
        bake(dirs[arch], r, tmp_path / "baked")
        model = load(dirs[arch])
        with applied(model, r):
            hooked = logits(model, tokenizer)
        baked = logits(load(tmp_path / "baked"), tokenizer)
        peft_model = peft(model, tmp_path / "lora")
        adapted = logits(peft_model, tokenizer)
        merged = logits(peft_model.merge_and_unload(), tokenizer)
        for other in (hooked, baked, merged):
            torch.testing.assert_close(adapted, other, rtol=0, atol=1e-5)
        torch.testing.assert_close(merged, baked, rtol=0, atol=1e-5)
        if factor != 1 - 1e-6:
            assert (adapted - logits(load(dirs[arch]), tokenizer)).abs().max() > 1e-4  # the adapter does something


def test_gpt2_mlp_act_exports_on_conv1d(dirs, tokenizer, tmp_path):
    r = spec("mlp.act")
    report = export_lora(dirs["gpt2"], r, tmp_path / "lora")
    assert report.target_modules == ["mlp.c_proj"]  # not attn.c_proj
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] is True
    model = load(dirs["gpt2"])
    with applied(model, r):
        hooked = logits(model, tokenizer)
    torch.testing.assert_close(logits(peft(model, tmp_path / "lora"), tokenizer), hooked,
                               rtol=0, atol=1e-5)


def test_adapter_files_rank_padding_and_provenance(dirs, tmp_path):
    r = Restraint(name="t", hook="attn.out", factor=0.5, units=UNITS, source={"diff": "runs/diff"})
    report = export_lora(dirs["llama"], r, tmp_path / "lora")
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    tensors = load_file(tmp_path / "lora" / "adapter_model.safetensors")
    assert report.rank == config["r"] == config["lora_alpha"] == 8 and report.max_units == 4
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM" and config["bias"] == "none"
    assert config["target_modules"] == ["o_proj"] and config["layers_to_transform"] == [0, 1]
    assert sorted(tensors) == [f"base_model.model.model.layers.{i}.self_attn.o_proj.lora_{ab}.weight"
                               for i in (0, 1) for ab in "AB"]
    for layer, units in UNITS.items():
        key = f"base_model.model.model.layers.{layer}.self_attn.o_proj"
        a, b = tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"]
        assert a.shape == (8, 64) and b.shape == (64, 8) and a.dtype == b.dtype == torch.float32
        assert not a[len(units):].any() and not b[:, len(units):].any()  # padding is zero
    assert "rolemrc" not in config   # PEFT's keys only: the provenance is in rolemrc.json and the metadata
    rolemrc = json.loads((tmp_path / "lora" / "rolemrc.json").read_text())
    assert rolemrc["stage"] == "lora"
    assert rolemrc["source_fingerprint"] == dir_fingerprint(dirs["llama"]) == report.source_fingerprint
    assert rolemrc["source"] == {"diff": "runs/diff"} and rolemrc["restraint"]["units"] == {"0": [1, 5, 7],
                                                                                           "1": [0, 2, 30, 41]}
    with safe_open(str(tmp_path / "lora" / "adapter_model.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["rolemrc_restraint"])["hook"] == "attn.out"
    assert export_lora(dirs["llama"], r, tmp_path / "lora16", rank=16).rank == 16
    with pytest.raises(RestraintError, match="rank 3 is below the 4 units"):
        export_lora(dirs["llama"], r, tmp_path / "lora3", rank=3)


@pytest.mark.parametrize(("arch", "hook", "reason"), [
    ("llama", "resid.post", "residual stream"),
    ("gpt2", "mlp.out", "bias"),
    ("gpt2", "attn.out", "bias"),
])
def test_refusals(dirs, tmp_path, arch, hook, reason):
    with pytest.raises(RestraintError, match=reason):
        export_lora(dirs[arch], spec(hook), tmp_path / "lora")
    assert not (tmp_path / "lora").exists()


def test_cli_lora(dirs, tmp_path):
    runner = CliRunner()
    spec("mlp.act", 0.0).save(tmp_path / "s.yaml")
    spec("resid.post").save(tmp_path / "resid.yaml")
    res = runner.invoke(app, ["intervene", "lora", "--restraint", str(tmp_path / "s.yaml"), "--model", str(dirs["qwen2"]),
                              "--out", str(tmp_path / "lora"), "--rank", "16"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["rank"] == 16
    assert (tmp_path / "lora" / "adapter_config.json").exists() and (tmp_path / "lora" / "adapter_model.safetensors").exists()
    res = runner.invoke(app, ["intervene", "lora", "--restraint", str(tmp_path / "resid.yaml"), "--model", str(dirs["qwen2"]),
                              "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "error:" in res.output and "resid.post cannot be folded" in res.output


def test_export_reads_only_the_folded_weights_from_a_sharded_checkpoint(dirs, tmp_path, monkeypatch):
    """A checkpoint in several safetensors shards exports the same adapter, and no full model is loaded."""
    import transformers

    from rolemrc.core.modeling import load_model

    model, tok = load_model(dirs["llama"], device="cpu")
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    tok.save_pretrained(sharded)
    assert len(list(sharded.glob("*.safetensors"))) > 2 and (sharded / "model.safetensors.index.json").is_file()
    r = Restraint(name="r", hook="mlp.post", factor=0.25, units={0: [1, 5, 9], 1: [2]})
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("export loaded the whole model"))
    export_lora(sharded, r, tmp_path / "a")
    export_lora(dirs["llama"], r, tmp_path / "b")
    a, b = load_file(tmp_path / "a" / "adapter_model.safetensors"), load_file(tmp_path / "b" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_adapter_cache_evicts_the_least_recently_used_within_its_caps(dirs, tmp_path):
    """Specs differing only by factor each make a folder; `evict_adapters` keeps the cache within count and bytes by
    mtime (which `cached` refreshes on use), never touching an adapter in use or an export under way."""
    import os
    import time

    from rolemrc.intervene.lora import STALE_S, LoraExporter, evict_adapters

    exporter, cache = LoraExporter(dirs["llama"]), tmp_path / "cache"
    made = [exporter.cached(spec("mlp.act", factor=0.5 + k * 1e-6), cache) for k in range(8)]
    assert len(set(made)) == 8
    for k, path in enumerate(made):   # distinct mtimes, oldest first
        os.utime(path, (1e9 + k, 1e9 + k))
    assert exporter.cached(spec("mlp.act", factor=0.5), cache) == made[0]   # a hit: now the most recent
    size = sum(f.stat().st_size for f in made[0].iterdir())
    exporting, stale = cache / ".export-live", cache / ".evict-123-dead"
    exporting.mkdir()
    stale.mkdir()
    os.utime(stale, (time.time() - STALE_S - 10,) * 2)

    evicted = evict_adapters(cache, max_count=5, max_bytes=1 << 30, keep=[made[1]])
    assert evicted == made[2:5]   # the oldest, sparing the one in use
    assert sorted(p.name for p in cache.iterdir()) == sorted([exporting.name] + [p.name for p in (made[0], made[1], *made[5:])])
    # (sizes differ by a few bytes: the factor is in the metadata)
    assert evict_adapters(cache, max_count=5, max_bytes=2 * size + 64, keep=[made[1]]) == made[5:]
    assert {p for p in cache.iterdir() if not p.name.startswith(".")} == {made[0], made[1]}
    # a cache already within its caps, or everything in use: nothing goes
    assert evict_adapters(cache, max_count=1, max_bytes=size, keep=[made[0], made[1]]) == []
    assert (made[0] / "adapter_model.safetensors").is_file() and exporting.is_dir()
