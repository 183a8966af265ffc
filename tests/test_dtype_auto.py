"""`--dtype auto` (every command's default) is the checkpoint's own dtype: a bf16 checkpoint is probed, checked and
served in bf16 and baked back to bf16 (config and safetensors), on the CPU as on a GPU; a float32 one stays float32."""

import json

import pytest
import torch
from fixtures import test_records as records_of
from safetensors import safe_open
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.errors import InputError
from rolemrc.core.io import write_jsonl
from rolemrc.core.modeling import load_model
from rolemrc.core.tiny import build_model
from rolemrc.intervene.spec import Restraint


@pytest.fixture(scope="module")
def bf16_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16")
    build_model("llama", tokenizer, seed=4, hidden=64, layers=2, intermediate=96).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    return path


def stored_dtypes(directory) -> set[str]:
    found = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), "pt") as fh:
            found |= {str(fh.get_slice(name).get_dtype()) for name in fh.keys()}  # noqa: SIM118 (a safetensors handle)
    return found


def test_bake_writes_the_dtype_it_read(bf16_dir, tmp_path):
    spec = tmp_path / "r.yaml"
    Restraint(name="r", hook="mlp.act", units={0: [1, 2, 3]}, factor=0.5).save(spec)
    result = CliRunner().invoke(app, ["intervene", "bake", "--model", str(bf16_dir), "--restraint", str(spec),
                                      "--out", str(tmp_path / "baked")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["dtype"] == "bfloat16"
    assert json.loads((tmp_path / "baked" / "config.json").read_text())["dtype"] == "bfloat16"
    assert stored_dtypes(tmp_path / "baked") == {"BF16"}
    # the fold at the checkpoint's dtype is the float32 fold cast once: the same bytes
    base = load_model(bf16_dir, device="cpu")[0]
    baked = load_model(tmp_path / "baked", device="cpu")[0]
    weight = base.model.layers[0].mlp.down_proj.weight.detach()   # mlp.act folds into the down projection's inputs
    expected = weight.clone()
    expected[:, [1, 2, 3]] = (weight[:, [1, 2, 3]].float() * 0.5).to(torch.bfloat16)
    assert torch.equal(baked.model.layers[0].mlp.down_proj.weight, expected)
    result = CliRunner().invoke(app, ["intervene", "check", "--model", str(bf16_dir), "--restraint", str(spec),
                                      "--baked", str(tmp_path / "baked"), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["dtype"] == "bfloat16" and report["weights_dtype"] == "bfloat16" and report["weight_elements_changed"] > 0


def test_collect_and_load_default_to_the_checkpoints_dtype(bf16_dir, model_dirs, tmp_path):
    from rolemrc.probe import collect

    assert next(load_model(bf16_dir, device="cpu")[0].parameters()).dtype == torch.bfloat16
    assert next(load_model(model_dirs["llama"], device="cpu")[0].parameters()).dtype == torch.float32
    assert collect(bf16_dir, records_of(4), progress=False).meta["dtype"] == "bfloat16"
    assert collect(bf16_dir, records_of(4), dtype="float32", progress=False).meta["dtype"] == "float32"
    with pytest.raises(InputError, match="unknown dtype 'float64'; choose one of auto, float32, bfloat16, float16"):
        collect(bf16_dir, records_of(4), dtype="float64")
    write_jsonl(tmp_path / "test.jsonl", records_of(2))
    result = CliRunner().invoke(app, ["probe", "collect", "--model", str(bf16_dir), "--data", str(tmp_path / "test.jsonl"),
                                      "--dtype", "float64", "--out", str(tmp_path / "p.safetensors")])
    assert result.exit_code == 2 and "float64" in result.output and not (tmp_path / "p.safetensors").exists()
