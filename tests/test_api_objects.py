"""The method's verbs on loaded models, as a notebook user calls them: bake, check and export_lora take a loaded
transformers model as well as a directory and give the same result; a PEFT-wrapped model is refused with the merge
it needs, by every verb that hooks or edits a model."""

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import rolemrc
from rolemrc.core.errors import RolemrcError
from rolemrc.intervene import Restraint, RestraintError

UNITS = {0: [1, 5, 7], 1: [0, 2, 30]}


def load(path, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_bake_of_a_loaded_model_folds_it_in_place_as_the_directory_bake_does(model_dirs, arch, tmp_path):
    r = Restraint(name="r", hook="mlp.act", factor=0.5, units=UNITS)
    from_dir = rolemrc.bake(model_dirs[arch], r, tmp_path / "from-dir")
    model = load(model_dirs[arch])
    in_memory = rolemrc.bake(model, r)
    assert in_memory.out_dir is None and in_memory.dtype == "float32"
    assert (in_memory.elements_scaled, in_memory.elements_changed_at_dtype) == (
        from_dir.elements_scaled, from_dir.elements_changed_at_dtype)
    baked = load(tmp_path / "from-dir").state_dict()
    assert all(torch.equal(p, baked[n]) for n, p in model.state_dict().items())

    saved = rolemrc.bake(load(model_dirs[arch]), r, tmp_path / "saved")   # tokenizer read from the model's directory
    assert saved.out_dir == str(tmp_path / "saved")
    assert all(torch.equal(p, baked[n]) for n, p in load(tmp_path / "saved").state_dict().items())
    AutoTokenizer.from_pretrained(tmp_path / "saved", local_files_only=True)
    record = json.loads((tmp_path / "saved" / "rolemrc.json").read_text())
    assert record["source_model"] == str(model_dirs[arch]) and record["source_fingerprint"] == in_memory.source_fingerprint


def test_bake_of_a_loaded_model_keeps_its_dtype_and_says_what_it_needs(model_dirs, tokenizer, tmp_path):
    r = Restraint(name="r", hook="mlp.act", factor=1 - 1e-6, units=UNITS)
    half = load(model_dirs["llama"], torch.bfloat16)
    with pytest.raises(RestraintError, match=r"its own dtype \(bfloat16\), not float32"):
        rolemrc.bake(half, r, dtype="float32")
    report = rolemrc.bake(half, r)
    assert report.dtype == "bfloat16" and report.numerical_noop   # 1 - 1e-6 rounds to 1 in bfloat16
    with pytest.raises(RestraintError, match="needs out_dir"):
        rolemrc.bake(model_dirs["llama"], r)
    nameless = load(model_dirs["llama"])
    nameless.config._name_or_path = ""
    before = {n: p.clone() for n, p in nameless.state_dict().items()}
    with pytest.raises(RolemrcError, match="pass tokenizer="):
        rolemrc.bake(nameless, r, tmp_path / "out")
    own = load(model_dirs["llama"])
    with pytest.raises(RestraintError, match="must differ from the source model directory"):
        rolemrc.bake(own, r, model_dirs["llama"])
    for refused in (nameless, own):   # a refused bake leaves the model as it was
        assert all(torch.equal(before[n], p) for n, p in refused.state_dict().items())
    rolemrc.bake(nameless, r, tmp_path / "out", tokenizer=tokenizer)
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_check_of_a_loaded_model_equals_the_directory_check(model_dirs, tmp_path):
    r = Restraint(name="r", hook="mlp.act", factor=0.5, units=UNITS)
    rolemrc.bake(model_dirs["llama"], r, tmp_path / "baked")
    prompts = ["Who keeps the lighthouse?", [{"role": "user", "content": "Sing to the ovens."}]]
    from_dir = rolemrc.check(model_dirs["llama"], r, baked_dir=tmp_path / "baked", prompts=prompts, device="cpu")
    model = load(model_dirs["llama"])
    before = {n: p.clone() for n, p in model.state_dict().items()}
    in_memory = rolemrc.check(model, r, baked_dir=tmp_path / "baked", prompts=prompts)
    assert in_memory.to_dict() == from_dir.to_dict()
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())   # check edits nothing
    assert rolemrc.check(model, r, prompts=prompts).weight_elements_changed == from_dir.weight_elements_changed


def test_export_lora_of_a_loaded_model_writes_the_directory_export(model_dirs, tmp_path):
    r = Restraint(name="r", hook="mlp.act", factor=0.0, units=UNITS)
    from_dir = rolemrc.export_lora(model_dirs["llama"], r, tmp_path / "from-dir")
    in_memory = rolemrc.export_lora(load(model_dirs["llama"]), r, tmp_path / "in-memory")
    a, b = load_file(tmp_path / "from-dir" / "adapter_model.safetensors"), load_file(tmp_path / "in-memory" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    config = json.loads((tmp_path / "in-memory" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(model_dirs["llama"])
    assert in_memory.rank == from_dir.rank and in_memory.target_modules == from_dir.target_modules


def test_every_verb_refuses_a_peft_wrapped_model_with_the_merge_it_needs(model_dirs, tokenizer, tmp_path):
    r = Restraint(name="r", hook="mlp.act", factor=0.0, units=UNITS)
    wrapped = get_peft_model(load(model_dirs["llama"]), LoraConfig(r=4, target_modules=["down_proj"]))
    calls = {"bake": lambda: rolemrc.bake(wrapped, r, tmp_path / "b"),
             "check": lambda: rolemrc.check(wrapped, r, tokenizer=tokenizer),
             "export_lora": lambda: rolemrc.export_lora(wrapped, r, tmp_path / "l"),
             "applied": lambda: rolemrc.applied(wrapped, r).__enter__(),
             "collect": lambda: rolemrc.collect(wrapped, ["Who keeps the lighthouse?"], tokenizer=tokenizer)}
    for verb, call in calls.items():
        with pytest.raises(RolemrcError, match=r"PeftModel with PEFT adapters: .*merge_and_unload\(\)") as caught:
            call()
        assert "merge" in str(caught.value), verb
    assert not (tmp_path / "b").exists() and not (tmp_path / "l").exists()
    merged = wrapped.merge_and_unload()
    assert rolemrc.bake(merged, r).elements_scaled > 0
