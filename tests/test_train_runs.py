"""Few-step base / SFT / DPO runs on fixture data with tiny sizes."""

import json
import math
import socket
import subprocess
import sys

import pytest
import torch
from fixtures import test_records as make_test_records
from safetensors.torch import load_file
from train_fixtures import pair_records, profile_records, sft_records
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from typer.testing import CliRunner

from rolemrc.core.io import write_jsonl
from rolemrc.train import (
    BaseTrainConfig,
    DataError,
    DPOTrainConfig,
    SFTTrainConfig,
    make_config,
    train_base,
    train_dpo,
    train_sft,
)
from rolemrc.train.cli import app
from rolemrc.train.sft import sft_trainer

FAST = {"trl.logging_steps": 1, "progress": False}
SHORT = {**FAST, "trl.max_length": 256}  # sft and dpo (the base stage packs blocks of block_size instead)
TINY = {"hidden": 64, "layers": 2, "intermediate": 96, "heads": 4, "max_positions": 256, "block_size": 64,
        "vocab_size": 400, "batch_size": 8}


def falling(history, key="loss"):
    values = [h[key] for h in history if key in h]
    assert values and all(math.isfinite(v) for v in values)
    k = max(1, len(values) // 4)
    return sum(values[:k]) / k > sum(values[-k:]) / k


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-data")
    write_jsonl(root / "sft.jsonl", sft_records(48))
    write_jsonl(root / "pairs.jsonl", pair_records(32))
    write_jsonl(root / "profiles.jsonl", profile_records())
    write_jsonl(root / "test.jsonl", make_test_records(8))
    return root


@pytest.fixture(scope="module")
def base(data, tmp_path_factory):
    config = make_config(BaseTrainConfig, data=[str(data)], out=str(tmp_path_factory.mktemp("base")),
                         **{"trl.max_steps": 30, "trl.learning_rate": 3e-3}, **TINY, **FAST)
    return train_base(config)


@pytest.fixture(scope="module")
def sft(base, data, tmp_path_factory):
    config = make_config(SFTTrainConfig, model=str(base.out_dir), data=[str(data / "sft.jsonl")],
                         out=str(tmp_path_factory.mktemp("sft")),
                         **{"trl.max_steps": 12, "trl.learning_rate": 2e-3}, **SHORT)
    return train_sft(config)


def sft_config(base, data, out, **kw):
    return make_config(SFTTrainConfig, model=str(base.out_dir), data=[str(data / "sft.jsonl")], out=str(out),
                       **{"trl.max_steps": 6, "trl.learning_rate": 2e-3, "trl.save_steps": 2, **SHORT, **kw})


def plain_load(path):
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True), AutoTokenizer.from_pretrained(path)


def test_base_learns_and_loads_in_plain_transformers(base):
    assert falling(base.history)
    model, tok = plain_load(base.out_dir)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 2
    assert tok.eos_token == "<|im_end|>" and "generation" in tok.chat_template
    manifest = json.loads(base.manifest.read_text())
    assert manifest["stage"] == "base" and manifest["corpus"]["conversations"] == 48 + 32
    assert manifest["data_report"]["kept"] == 48 + 32 + 4 + 8
    assert not (base.out_dir / "checkpoints").exists()  # removed after success by default


def test_sft_masks_everything_but_assistant_replies(base, data, tmp_path):
    trainer, _, _ = sft_trainer(sft_config(base, data, tmp_path))
    tok = trainer.processing_class
    example = trainer.train_dataset[0]
    batch = trainer.data_collator([example])
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    trained, rendered = tok.decode(ids[labels != -100]), tok.decode(ids)
    record = next(r for r in sft_records(48) if all(t["content"] in rendered for t in r["conversations"]))
    replies = [t["content"] + "<|im_end|>" for t in record["conversations"] if t["role"] == "Assistant"]
    assert trained == "".join(replies)  # reply tokens and their end-of-turn only
    assert rendered.startswith("<|im_start|>system")


def test_sft_loss_falls_and_output_loads(sft, base, data):
    assert falling(sft.history)
    model, _ = plain_load(sft.out_dir)
    manifest = json.loads(sft.manifest.read_text())
    assert manifest["base_model"]["stage"] == "base" and manifest["metrics"]["steps"] == 12
    assert list(manifest["data"]) == [str(data / "sft.jsonl")] and len(manifest["data"][str(data / "sft.jsonl")]) == 16
    before = load_file(base.out_dir / "model.safetensors")
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items() if k in before)


def test_dpo_margin_rises_against_a_frozen_reference(sft, data, tmp_path):
    config = make_config(DPOTrainConfig, model=str(sft.out_dir), data=[str(data / "pairs.jsonl")], out=str(tmp_path),
                         batch_size=8, **{"trl.max_steps": 10, "trl.learning_rate": 1e-3}, **SHORT)
    result = train_dpo(config)
    margins = [h["rewards/margins"] for h in result.history]
    assert margins[0] == pytest.approx(0.0, abs=1e-6)  # policy == reference at the start
    assert falling(result.history) and margins[-1] > margins[0] + 0.1
    model, _ = plain_load(result.out_dir)
    sft_weights = load_file(sft.out_dir / "model.safetensors")  # the reference (the SFT directory) is untouched
    assert any(not torch.equal(sft_weights[k], v) for k, v in model.state_dict().items() if k in sft_weights)
    assert json.loads(result.manifest.read_text())["base_model"]["stage"] == "sft"


class Interrupt(TrainerCallback):
    """Dies at the start of step 5, after checkpoint-4 is written."""

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 4:
            raise KeyboardInterrupt


def test_resume_continues_from_the_last_checkpoint(base, data, tmp_path):
    straight = train_sft(sft_config(base, data, tmp_path / "straight"))
    with pytest.raises(KeyboardInterrupt):
        train_sft(sft_config(base, data, tmp_path / "cut"), callbacks=(Interrupt(),))
    assert (tmp_path / "cut" / "checkpoints" / "checkpoint-4").is_dir()
    resumed = train_sft(sft_config(base, data, tmp_path / "cut"))
    assert resumed.resumed_from.endswith("checkpoint-4") and resumed.metrics["steps"] == 6
    a, b = load_file(straight.out_dir / "model.safetensors"), load_file(resumed.out_dir / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)  # same result as the uninterrupted run
    fresh = train_sft(sft_config(base, data, tmp_path / "cut", resume=False, **{"trl.max_steps": 2}))
    assert fresh.resumed_from is None


def test_data_parallel_launch_two_processes_unchanged(base, data, tmp_path):
    """The same CLI under torch.distributed.run (what `accelerate launch --multi_gpu` runs), 2 CPU processes
    over gloo: the records are sharded, so each step covers twice as many and one rank writes the output."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "rolemrc.cli", "train", "sft", "--model", str(base.out_dir), "--data", str(data / "sft.jsonl"),
           "--out", str(out), "--set", "trl.max_steps=3", "--set", "batch_size=4", "--set", "trl.max_length=256"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = json.loads((out / "rolemrc.json").read_text())["metrics"]
    assert metrics["steps"] == 3 and metrics["epoch"] == pytest.approx(3 * 4 * 2 / 48, abs=1e-3)
    AutoModelForCausalLM.from_pretrained(out)


def test_lora_is_merged_into_a_plain_checkpoint(base, data, tmp_path):
    result = train_sft(sft_config(base, data, tmp_path, lora=True, lora_r=4,
                                  **{"trl.max_steps": 4, "trl.learning_rate": 1e-2}))
    assert not list(result.out_dir.glob("adapter_*"))
    weights = load_file(result.out_dir / "model.safetensors")
    assert not any("lora" in k for k in weights)
    before = load_file(base.out_dir / "model.safetensors")
    assert set(weights) == set(before)
    changed = [k for k in weights if not torch.equal(weights[k], before[k])]
    assert changed and all("proj" in k for k in changed)  # only adapted linear layers moved
    assert falling(result.history) or result.history[-1]["loss"] < result.history[0]["loss"]
    plain_load(result.out_dir)


def test_too_many_bad_records_fail_with_counts(base, tmp_path):
    bad = sft_records(4) + [{"conversations": [{"role": "user", "content": "x"}]}] * 2
    write_jsonl(tmp_path / "bad.jsonl", bad)
    config = make_config(SFTTrainConfig, model=str(base.out_dir), data=[str(tmp_path / "bad.jsonl")],
                         out=str(tmp_path / "o"), **{"trl.max_steps": 1}, **SHORT)
    with pytest.raises(DataError, match=r"2 of 6 SFT records are bad.*no assistant turn: 2"):
        train_sft(config)
    assert not (tmp_path / "o").exists()


def test_cli_reports_and_fails_clearly(sft, data, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["dpo", "--model", str(sft.out_dir), "--data", str(data / "pairs.jsonl"),
                                 "--out", str(tmp_path / "dpo"), "--max-steps", "2", "--no-progress",
                                 "--set", "trl.max_length=256", "--beta", "0.2", "--set", "trl.loss_type=ipo"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    assert summary["stage"] == "dpo" and summary["metrics"]["steps"] == 2
    manifest = json.loads((tmp_path / "dpo" / "rolemrc.json").read_text())
    assert manifest["config"]["trl"]["beta"] == 0.2 and manifest["config"]["trl"]["loss_type"] == ["ipo"]
    assert manifest["trainer_arguments"]["loss_type"] == ["ipo"] and manifest["trainer_arguments"]["max_length"] == 256
    result = runner.invoke(app, ["sft", "--model", str(sft.out_dir), "--data", str(tmp_path / "none.jsonl"),
                                 "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "none.jsonl: no such file or folder" in result.output
