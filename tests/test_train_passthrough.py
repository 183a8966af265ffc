"""Trainer arguments pass straight through to trl: `trl:` in YAML, `--set trl.KEY=...`, typos, flat names refused."""

import pytest
import torch
from train_fixtures import PROFILE_ARGUMENTS_BEFORE
from trl import DPOConfig, SFTConfig

from rolemrc.train.config import (
    STAGE_CONFIGS,
    DPOTrainConfig,
    SFTTrainConfig,
    TrainConfigError,
    help_text,
    make_config,
    parse_overrides,
)
from rolemrc.train.runner import build_arguments, trainer_arguments

REQ = {"base": {"data": ["d"], "out": "o"}, "sft": {"model": "m", "data": ["d"], "out": "o"},
       "dpo": {"model": "m", "data": ["d"], "out": "o"}}


@pytest.fixture
def no_gpu(monkeypatch):
    """The machine the before-values were written down on: no GPU, one process."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_set_trl_loss_type_reaches_dpo_config(no_gpu):
    config = make_config(DPOTrainConfig, **REQ["dpo"], **parse_overrides(["trl.loss_type=ipo", "trl.beta=0.3"]))
    args = build_arguments(config)
    assert isinstance(args, DPOConfig) and args.loss_type == ["ipo"] and args.beta == 0.3


def test_trl_mapping_and_set_reach_sft_config(no_gpu, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("sft:\n  trl:\n    optim: adafactor\n    adam_beta2: 0.95\n")
    config = make_config(SFTTrainConfig, config_file=cfg, **REQ["sft"],
                         **parse_overrides(["gradient_checkpointing=true", "trl.adam_beta2=9.8e-1"]))
    args = build_arguments(config)
    assert isinstance(args, SFTConfig)
    assert (args.optim, args.adam_beta2, args.gradient_checkpointing) == ("adafactor", 0.98, True)
    assert args.learning_rate == 5e-4 and args.max_length == 1024  # the profile's trl entries merge, key by key


@pytest.mark.parametrize("overrides, message", [
    ({"trl.los_type": "ipo"}, r"unknown dpo trainer argument trl.los_type \(DPOConfig has no such field\); "
                              r"did you mean loss_type"),
    ({"optim": "adafactor"}, r"unknown dpo setting 'optim'; optim is a trainer argument: write it under `trl:`"),
    ({"bta": 0.2}, r"unknown dpo setting 'bta'; did you mean trl.beta"),
    ({"bach_size": 2}, r"unknown dpo setting 'bach_size'; did you mean batch_size"),
    ({"trl.per_device_train_batch_size": 2}, r"derived from rolemrc's `batch_size` setting"),
    ({"trl.gradient_checkpointing": True}, r"derived from rolemrc's `gradient_checkpointing` setting"),
    ({"trl": "ipo"}, r"`trl` must be a mapping"),
    ({"trl.adam_beta2": "high"}, r"DPOConfig.adam_beta2: cannot use 'high' as float"),
    ({"trl.beta": 0}, r"beta must be > 0"),
])
def test_bad_trainer_arguments_are_named(overrides, message):
    with pytest.raises(TrainConfigError, match=message):
        make_config(DPOTrainConfig, **REQ["dpo"], **overrides)


def test_a_value_trl_refuses_is_a_config_error(no_gpu):
    config = make_config(SFTTrainConfig, **REQ["sft"], **{"trl.optim": "no_such_optimiser"})
    with pytest.raises(TrainConfigError, match=r"SFTConfig: .*no_such_optimiser"):
        build_arguments(config)


@pytest.mark.parametrize("key", sorted(PROFILE_ARGUMENTS_BEFORE))
def test_profiles_resolve_to_the_same_trainer_arguments_as_before(no_gpu, key):
    profile, stage = key.split("/")
    config = make_config(STAGE_CONFIGS[stage], profile=profile, **REQ[stage])
    assert trainer_arguments(config) == PROFILE_ARGUMENTS_BEFORE[key]
    cls = config.arguments_class()   # paper's bf16 autocasts on the CPU too (use_cpu)
    assert build_arguments(config).to_dict() == cls(**PROFILE_ARGUMENTS_BEFORE[key]).to_dict()


def test_trainer_arguments_have_one_name_trl_key():
    """`trl: {KEY: ...}` and `trl.KEY` name the same argument; the flat name is refused, naming where it goes."""
    dotted = make_config(SFTTrainConfig, **REQ["sft"], **{"trl.learning_rate": "1e-4", "trl.warmup_steps": 0.2,
                                                          "trl.max_length": 64})
    nested = make_config(SFTTrainConfig, **REQ["sft"], trl={"learning_rate": 1e-4, "warmup_steps": 0.2,
                                                           "max_length": 64})
    assert dotted.trl == nested.trl and dotted.trl["learning_rate"] == 1e-4
    for flat in ("learning_rate", "max_length", "warmup_steps"):
        with pytest.raises(TrainConfigError, match=f"unknown sft setting '{flat}'; {flat} is a trainer argument: write it "
                                              f"under `trl:` \\(--set trl.{flat}=...\\)"):
            make_config(SFTTrainConfig, **REQ["sft"], **{flat: 1e-4})
    with pytest.raises(TrainConfigError, match="unknown sft setting 'warmup_ratio'"):
        make_config(SFTTrainConfig, **REQ["sft"], warmup_ratio=0.2)


def test_help_comes_from_the_config_module():
    assert help_text(SFTTrainConfig, "batch_size") == "per-device batch size"
    assert help_text(DPOTrainConfig, "lora_r") == "LoRA rank"



def test_cli_refuses_a_typo_with_a_suggestion(tmp_path):
    from typer.testing import CliRunner

    from rolemrc.train.cli import app

    result = CliRunner().invoke(app, ["dpo", "--model", "m", "--data", "d.jsonl", "--out", str(tmp_path),
                                      "--set", "trl.los_type=ipo"])
    assert result.exit_code == 2
    assert "error: unknown dpo trainer argument trl.los_type" in result.output and "loss_type" in result.output
