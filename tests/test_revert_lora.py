"""A revert as an exact PEFT LoRA adapter where the DPO model's change from its SFT model is low-rank (a LoRA-trained
DPO, merged): real PEFT on the export equals the baked revert to 1e-5 relative on float32 logits; a full-rank delta,
one above the rank cap, and a change of embeddings or norms are refused by name."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from test_intervene_lora import load, logits, peft
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.intervene import Restraint, RestraintError, bake, export_lora
from rolemrc.intervene.kinds import revert_restraint
from rolemrc.intervene.lora import LoraExporter

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def relative(a, b):
    return float((a - b).abs().max() / b.abs().max())


def saved(model, tokenizer, path):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def lora_dpo(model_dirs, tokenizer, tmp_path_factory):
    """The llama fixture as SFT and a "LoRA-trained DPO": a random rank-4 PEFT LoRA on every linear layer, merged."""
    torch.manual_seed(0)
    peft_model = get_peft_model(load(model_dirs["llama"]), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                      init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.1)   # a change of a few percent of each weight, as training makes
    return model_dirs["llama"], saved(peft_model.merge_and_unload(), tokenizer, tmp_path_factory.mktemp("lora-dpo"))


def moved(sft, tokenizer, path, edit):
    """The SFT model with `edit(name, parameter)` applied to every parameter in place, saved to `path`."""
    model = load(sft)
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            edit(name, p, torch.Generator().manual_seed(i))
    return saved(model, tokenizer, path)


def revert(sft, **fields):
    return Restraint(name="v", hook="mlp.act", kind="revert", reference={"name": str(sft)}, **fields)


@pytest.mark.parametrize(("fields", "targets"), [({"alpha": 0.5, "scope": "model"}, 14),
                                                 ({"alpha": 1.0, "scope": "model"}, 14),
                                                 ({"alpha": 0.5, "scope": "layers", "layers": [1]}, 7),
                                                 ({"alpha": 1.0, "scope": "units", "units": {0: [3, 4, 50]}}, 3)])
def test_a_low_rank_revert_exports_as_a_lora_that_equals_its_bake(lora_dpo, tokenizer, tmp_path, fields, targets):
    sft, dpo = lora_dpo
    r = revert(sft, **fields)
    report = export_lora(dpo, r, tmp_path / "lora")
    assert (report.rank, report.max_units, len(report.target_modules)) == (8, 4 if fields["scope"] != "units" else 3,
                                                                           targets)
    assert report.layers == fields.get("layers", [0] if fields["scope"] == "units" else [0, 1])
    bake(dpo, r, tmp_path / "baked")
    baked = logits(load(tmp_path / "baked"), tokenizer)
    adapted = logits(peft(load(dpo), tmp_path / "lora"), tokenizer)
    assert relative(adapted, baked) <= 1e-5, relative(adapted, baked)
    assert relative(adapted, logits(load(dpo), tokenizer)) > 1e-3   # the adapter does something
    if fields == {"alpha": 1.0, "scope": "model"}:
        assert relative(adapted, logits(load(sft), tokenizer)) <= 1e-5   # all the way back to the SFT model


def test_the_cli_and_a_loaded_model_export_the_same_revert_adapter(lora_dpo, tmp_path):
    sft, dpo = lora_dpo
    revert_restraint(sft, 0.5, "layers", layers="0").save(tmp_path / "revert.yaml")   # records sft's fingerprint
    res = CliRunner().invoke(app, ["intervene", "lora", "--model", str(dpo), "--restraint", str(tmp_path / "revert.yaml"),
                                   "--out", str(tmp_path / "lora")])
    assert res.exit_code == 0, res.output
    assert '"rank": 8' in res.output
    export_lora(load(dpo), tmp_path / "revert.yaml", tmp_path / "loaded")
    files = [load_file(tmp_path / out / "adapter_model.safetensors") for out in ("lora", "loaded")]
    assert len(files[0]) == 14 and all(torch.equal(files[0][k], files[1][k]) for k in files[0])
    assert LoraExporter(dpo).check(tmp_path / "revert.yaml").kind == "revert"


def test_a_revert_no_lora_holds_exactly_is_refused_naming_the_weight(lora_dpo, model_dirs, tokenizer, tmp_path):
    sft, dpo = lora_dpo
    with pytest.raises(RestraintError, match=r"model.layers.0.self_attn.q_proj.weight moves toward the reference by a "
                                             r"delta of numerical rank 4, above the rank cap 2; bake the revert"):
        export_lora(dpo, revert(sft, alpha=0.5, scope="model"), tmp_path / "x", rank=2)

    def full(name, p, g):   # a full fine-tune's change of every Linear weight
        if name.endswith(tuple(f"{n}.weight" for n in LINEAR)):
            p.add_(0.01 * torch.randn(p.shape, generator=g))

    full_dpo = moved(sft, tokenizer, tmp_path / "full", full)
    with pytest.raises(RestraintError, match=r"model.layers.0.self_attn.q_proj.weight moves toward the reference by a "
                                             r"delta of numerical rank 64, not low-rank: .* 64 x 64 weight"):
        export_lora(full_dpo, revert(sft, alpha=0.5, scope="model"), tmp_path / "x")
    # a unit revert masks the delta to the units' rows and columns: rank at most their count, whatever the training
    units = export_lora(full_dpo, revert(sft, alpha=1.0, scope="units", units={1: [2, 9]}), tmp_path / "units")
    assert units.max_units == 2 and units.layers == [1]
    for part, scope in (("embed_tokens", {"scope": "model"}), ("layers.1.input_layernorm", {"scope": "layers",
                                                                                             "layers": [1]})):
        def nudge(name, p, g, part=part):
            if part in name or name.endswith("q_proj.weight"):
                p.add_(0.01 * torch.randn(p.shape, generator=g))

        other = moved(sft, tokenizer, tmp_path / part, nudge)
        kind = "Embedding" if part == "embed_tokens" else "LlamaRMSNorm"
        with pytest.raises(RestraintError, match=rf"model.{part}.weight \({kind}\) differs from the reference .*, and "
                                                 r"the adapter adds only to Linear layers' weights \(LoRA of embeddings"):
            export_lora(other, revert(sft, alpha=0.5, **scope), tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_a_revert_whose_scope_the_model_has_not_moved_exports_nothing(lora_dpo, tmp_path):
    sft, _ = lora_dpo
    with pytest.raises(RestraintError, match="no Linear weight in its scope differs from the reference"):
        export_lora(sft, revert(sft, alpha=0.5, scope="model"), tmp_path / "x")
