"""`--dtype` and `--gradient-checkpointing` in training: the dtype a stage trains at, the autocast that goes with it,
the dtype it saves at, LoRA with activation checkpointing, and a bad dtype refused before any model loads."""

import json

import pytest
import torch
from safetensors.torch import load_file
from train_fixtures import sft_records
from transformers import TrainerCallback
from typer.testing import CliRunner

from rolemrc.core.io import write_jsonl
from rolemrc.core.tiny import build_model
from rolemrc.organism.config import OrganismConfig
from rolemrc.train import DPOTrainConfig, SFTTrainConfig, TrainConfigError, make_config, train_sft
from rolemrc.train.cli import app
from rolemrc.train.runner import train_dtype, trainer_arguments

# two steps of SFT on the CPU whatever the machine (trl.use_cpu), at a rate that moves bf16 weights
STEPS = {"trl.max_steps": 2, "trl.learning_rate": 1e-2, "trl.max_length": 128, "trl.use_cpu": True,
         "batch_size": 2, "progress": False}


def save_llama(path, tokenizer, dtype: torch.dtype):
    build_model("llama", tokenizer, seed=0, hidden=64, layers=2, intermediate=96).to(dtype).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory, tokenizer):
    """A tiny Llama saved in bfloat16 (config.json: "dtype": "bfloat16")."""
    path = save_llama(tmp_path_factory.mktemp("bf16-llama"), tokenizer, torch.bfloat16)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    return path


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft-data") / "sft.jsonl"
    write_jsonl(path, sft_records(8))
    return path


class Seen(TrainerCallback):
    """What the model held just before each optimiser step: its parameters' dtypes, the names of those with a
    gradient, the dtypes of those, and whether it checkpoints activations."""

    def __init__(self):
        self.dtypes, self.with_grad, self.grad_dtypes, self.checkpointing = set(), set(), set(), set()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        for name, param in model.named_parameters():
            self.dtypes.add(param.dtype)
            if param.grad is not None:
                self.with_grad.add(name)
                self.grad_dtypes.add(param.dtype)
        self.checkpointing.add(model.is_gradient_checkpointing)


def train(model, data, out, **settings):
    seen = Seen()
    config = make_config(SFTTrainConfig, model=str(model), data=[str(data)], out=str(out), **{**STEPS, **settings})
    result = train_sft(config, callbacks=(seen,))
    return result, seen, json.loads(result.manifest.read_text())


def saved(out) -> tuple[str, set[torch.dtype]]:
    """The saved model's config dtype and its tensors' dtypes."""
    return (json.loads((out / "config.json").read_text())["dtype"],
            {t.dtype for t in load_file(out / "model.safetensors").values()})


def changed(a, b) -> bool:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return any(not torch.equal(x[k].float(), y[k].float()) for k in x)


def test_a_bf16_checkpoint_trained_at_bfloat16_keeps_bf16_weights(bf16_model, sft_data, tmp_path):
    """Full fine-tuning at --dtype bfloat16 on the CPU: bf16 weights under bf16 autocast (which on a CPU needs
    use_cpu), no activation checkpointing by default there, saved in bf16 and moved."""
    result, seen, manifest = train(bf16_model, sft_data, tmp_path / "out", dtype="bfloat16")
    assert seen.dtypes == {torch.bfloat16} and seen.checkpointing == {False}
    arguments = manifest["trainer_arguments"]
    assert (arguments["bf16"], arguments["use_cpu"], arguments["gradient_checkpointing"]) == (True, True, False)
    assert manifest["dtype"] == {"trained": "bfloat16", "saved": "bfloat16"}
    assert saved(result.out_dir) == ("bfloat16", {torch.bfloat16})
    assert changed(bf16_model, result.out_dir)


def test_auto_on_the_cpu_trains_float32_and_saves_the_checkpoints_dtype(bf16_model, sft_data, tmp_path):
    """--dtype auto (the default) on the CPU: float32 weights without autocast; the saved model is bf16 again, as the
    checkpoint it started from."""
    result, seen, manifest = train(bf16_model, sft_data, tmp_path / "out")
    assert seen.dtypes == {torch.float32}
    assert manifest["config"]["dtype"] == "auto" and manifest["trainer_arguments"]["bf16"] is False
    assert manifest["dtype"] == {"trained": "float32", "saved": "bfloat16"}
    assert saved(result.out_dir) == ("bfloat16", {torch.bfloat16})
    assert changed(bf16_model, result.out_dir)


def test_lora_with_gradient_checkpointing_trains_the_adapters_only(bf16_model, sft_data, tmp_path):
    """LoRA over bf16 weights with activation checkpointing: a step runs, only adapter parameters (float32: peft's
    default) get gradients, and the merged, saved model is bf16 and differs from the base."""
    result, seen, manifest = train(bf16_model, sft_data, tmp_path / "out", dtype="bfloat16", lora=True,
                                   gradient_checkpointing=True)
    assert seen.checkpointing == {True} and manifest["trainer_arguments"]["gradient_checkpointing"] is True
    assert seen.with_grad and all(".lora_A." in name or ".lora_B." in name for name in seen.with_grad)
    assert seen.grad_dtypes == {torch.float32} and torch.bfloat16 in seen.dtypes
    assert saved(result.out_dir) == ("bfloat16", {torch.bfloat16})
    assert changed(bf16_model, result.out_dir)


@pytest.mark.parametrize("args, message", [
    (["--dtype", "foo"], "Invalid value for '--dtype': 'foo' is not one of"),
    (["--set", "dtype=foo"], "dtype: unknown dtype 'foo'; choose one of auto, float32, bfloat16, float16"),
    (["--dtype", "float16"], "dtype: float16 weights train LoRA adapters only"),
    (["--dtype", "bfloat16", "--set", "trl.fp16=true"], "trl.fp16 autocasts bfloat16 weights"),
])
def test_a_bad_dtype_is_one_error_line_before_any_model_loads(bf16_model, sft_data, tmp_path, monkeypatch, args,
                                                              message):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("rolemrc.core.modeling.load_model", no_loading)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["sft", "--model", str(bf16_model), "--data", str(sft_data), "--out", str(out),
                                      "--no-progress", *args])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert message in lines[0] and not out.exists()


def test_a_dtype_in_a_config_file_stands_unless_the_command_line_gives_one(tmp_path, monkeypatch):
    import rolemrc.train

    seen = []

    def stop(config):
        seen.append(config.dtype)
        raise TrainConfigError("stop")

    monkeypatch.setattr(rolemrc.train, "train_sft", stop, raising=False)
    (tmp_path / "c.yaml").write_text("sft:\n  dtype: bfloat16\n")
    for given in ([], ["--dtype", "float32"], ["--dtype", "auto"]):
        CliRunner().invoke(app, ["sft", "--model", "m", "--data", "d.jsonl", "--out", str(tmp_path / "o"),
                                 "--config", str(tmp_path / "c.yaml"), *given])
    assert seen == ["bfloat16", "float32", "auto"]


@pytest.fixture
def gpu(monkeypatch):
    """A machine that says it has a GPU (nothing is built or run on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def config(cls=SFTTrainConfig, **settings):
    return make_config(cls, model=settings.pop("model"), data=["d.jsonl"], out="o", **settings)


def test_auto_is_the_checkpoints_dtype_on_a_gpu_with_its_autocast_and_checkpointing(gpu, bf16_model):
    auto = config(model=str(bf16_model))
    arguments = trainer_arguments(auto)
    assert train_dtype(auto) == "bfloat16"
    assert (arguments["bf16"], arguments["fp16"], arguments["gradient_checkpointing"]) == (True, False, True)
    assert not arguments["use_cpu"]
    assert train_dtype(config(model=str(bf16_model), **{"trl.use_cpu": True})) == "float32"   # told to use the CPU
    off = trainer_arguments(config(model=str(bf16_model), gradient_checkpointing=False))
    assert off["gradient_checkpointing"] is False


def test_auto_is_float32_on_the_cpu_whatever_the_checkpoint(monkeypatch, bf16_model):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    auto = config(model=str(bf16_model))
    arguments = trainer_arguments(auto)
    assert train_dtype(auto) == "float32" and "fp16" not in arguments
    assert (arguments["bf16"], arguments["gradient_checkpointing"], arguments["use_cpu"]) == (False, False, False)


def test_a_float16_checkpoint_on_a_gpu_trains_with_lora_under_fp16_autocast(gpu, tmp_path, tokenizer):
    fp16_model = save_llama(tmp_path / "fp16", tokenizer, torch.float16)
    lora = trainer_arguments(config(DPOTrainConfig, model=str(fp16_model), lora=True))
    assert (lora["fp16"], lora["bf16"]) == (True, False)
    with pytest.raises(TrainConfigError, match=r"dtype auto \(.* is stored in float16; this runs on a GPU\): float16 "
                                               "weights train LoRA adapters only"):
        trainer_arguments(config(DPOTrainConfig, model=str(fp16_model)))


def test_float32_weights_take_the_autocast_trl_says(monkeypatch, bf16_model):
    """float32 weights keep trl.bf16 as given (the paper profile's mixed precision over float32 weights)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    arguments = trainer_arguments(config(model=str(bf16_model), dtype="float32", **{"trl.bf16": True}))
    assert (arguments["bf16"], arguments["use_cpu"]) == (True, True)


def test_gradient_checkpointing_is_a_setting_not_a_trainer_argument():
    with pytest.raises(TrainConfigError, match="trl.gradient_checkpointing is derived from rolemrc's "
                                               "`gradient_checkpointing` setting"):
        config(model="m", **{"trl.gradient_checkpointing": True})


def test_organisms_train_at_their_dtype_keyed_by_what_they_trained_at(tmp_path, monkeypatch):
    """--dtype reaches the organism's DPO config; its training stage is keyed by the dtype it trains at, float32 (what
    organisms trained at before the setting) left out; float16 is refused for the units organism's full update."""
    from rolemrc.organism.build import _train_stage

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    class Keys:
        def run(self, name, key, run, outputs):
            return key

    def key(**settings):
        config = OrganismConfig(kind="narration", out=str(tmp_path), **settings)
        return _train_stage(Keys(), tmp_path / "narration", tmp_path / "sft", tmp_path / "pairs.jsonl", config, None)

    assert "dtype" not in key() and key(dtype="bfloat16")["dtype"] == "bfloat16"
    assert key()["settings"] == key(dtype="bfloat16")["settings"]
    with pytest.raises(TrainConfigError, match="--dtype: float16 weights train LoRA adapters only"):
        OrganismConfig(kind="units", out=str(tmp_path), dtype="float16")
