"""Train configs: profiles, override order, coercion, effective batch."""

import pytest

from rolemrc.train.config import (
    BaseTrainConfig,
    DPOTrainConfig,
    SFTTrainConfig,
    TrainConfigError,
    accumulation_steps,
    make_config,
    parse_overrides,
)
from rolemrc.train.runner import trainer_arguments

REQ = {"sft": {"model": "m", "data": ["d.jsonl"], "out": "o"}, "dpo": {"model": "m", "data": ["d.jsonl"], "out": "o"}}


def test_paper_profile_has_the_published_settings():
    sft = make_config(SFTTrainConfig, profile="paper", **REQ["sft"])
    assert (sft.trl["learning_rate"], sft.trl["lr_scheduler_type"], sft.trl["warmup_steps"], sft.trl["num_train_epochs"],
            sft.effective_batch_size) == (2e-5, "cosine", 0.04, 1, 64)
    dpo = make_config(DPOTrainConfig, profile="paper", **REQ["dpo"])
    assert (dpo.trl["beta"], dpo.trl["learning_rate"], dpo.trl["lr_scheduler_type"], dpo.trl["warmup_steps"],
            dpo.trl["num_train_epochs"], dpo.effective_batch_size) == (0.1, 4e-7, "linear", 0.1, 1, 64)
    with pytest.raises(TrainConfigError, match="no 'base' section"):
        make_config(BaseTrainConfig, profile="paper", data=["x"], out="o")


def test_tiny_base_model_has_head_dim_64_for_vllm():
    base = make_config(BaseTrainConfig, profile="tiny", data=["x"], out="o")
    assert (base.hidden // base.heads, base.layers, base.intermediate) == (64, 4, 512)


def test_override_order_and_coercion(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("sft:\n  batch_size: 2\n  lora: 'yes'\n  trl:\n    learning_rate: 2e-4\n")  # YAML reads 2e-4 as a string
    sft = make_config(SFTTrainConfig, profile="tiny", config_file=cfg, batch_size=3, **REQ["sft"])
    assert sft.trl["learning_rate"] == 2e-4 and isinstance(sft.trl["learning_rate"], float)
    assert sft.batch_size == 3 and sft.lora is True
    assert sft.trl["warmup_steps"] == 0.04  # from the profile
    flat = tmp_path / "flat.yaml"
    flat.write_text("trl:\n  beta: 0.5\n")
    assert make_config(DPOTrainConfig, profile="tiny", config_file=flat, **REQ["dpo"]).trl["beta"] == 0.5


@pytest.mark.parametrize("overrides, message", [
    ({"learnign_rate": 1.0}, "unknown sft setting"),
    ({"batch_size": "many"}, "cannot use 'many' as int"),
    ({"batch_size": 2.5}, "cannot use 2.5 as int"),
    ({"trl.learning_rate": -1.0}, "learning_rate must be > 0"),
    ({"effective_batch_size": 4, "batch_size": 8}, "effective_batch_size 4 < batch_size 8"),
])
def test_bad_settings_are_named(overrides, message):
    with pytest.raises(TrainConfigError, match=message):
        make_config(SFTTrainConfig, profile="tiny", **{**REQ["sft"], **overrides})


def test_missing_required_and_unknown_profile(tmp_path):
    with pytest.raises(TrainConfigError, match=r"missing required setting\(s\) \['model'\]"):
        make_config(SFTTrainConfig, profile="tiny", data=["d"], out="o")
    with pytest.raises(TrainConfigError, match="unknown profile 'huge'.*paper.*tiny"):
        make_config(SFTTrainConfig, profile="huge", **REQ["sft"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("sft: [1, 2]\n")
    with pytest.raises(TrainConfigError, match="section 'sft' must be a mapping"):
        make_config(SFTTrainConfig, profile=bad, **REQ["sft"])


def test_parse_overrides():
    assert parse_overrides(["learning-rate=1e-4", "lora=true", "mix=[a.jsonl:0.3]"]) == {
        "learning_rate": "1e-4", "lora": True, "mix": ["a.jsonl:0.3"]}
    with pytest.raises(TrainConfigError, match="key=value"):
        parse_overrides(["lora"])


def test_effective_batch_sets_accumulation(monkeypatch):
    sft = make_config(SFTTrainConfig, profile="paper", **REQ["sft"])  # batch 4, effective 64
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert accumulation_steps(sft) == 16
    assert trainer_arguments(sft)["gradient_accumulation_steps"] == 16
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert accumulation_steps(sft) == 2
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(TrainConfigError, match="not a multiple"):
        accumulation_steps(sft)
