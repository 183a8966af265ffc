"""`rolemrc train base|sft|dpo`. Settings: profile < --config YAML < --set key=value < explicit options.

Any trainer argument of the stage (transformers' TrainingArguments, trl's SFTConfig / DPOConfig) can be set
with `--set trl.KEY=VALUE` (e.g. `--set trl.optim=adafactor --set trl.loss_type=ipo`).

Multi-GPU: `accelerate launch --num_processes 8 $(which rolemrc) train sft ...` runs unchanged;
gradient accumulation is derived so that the effective batch stays as configured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from typer._click.core import ParameterSource

from rolemrc.core.cli import cli_app
from rolemrc.core.extras import needs
from rolemrc.core.placement import Dtype, dtype_option
from rolemrc.train.config import BaseTrainConfig, DPOTrainConfig, SFTTrainConfig, TrainConfig, help_text

app = cli_app(help="Train a small base model from scratch (the embedded default); SFT and DPO (trl) on any causal LM.")


def option(name: str, default: Any = None, *flags: str, cls: type[TrainConfig] = TrainConfig) -> Any:
    """A typer option whose help is the setting's help in rolemrc.train.config."""
    return typer.Option(default, *flags, help=help_text(cls, name))


def trainer_option(key: str, help: str, *flags: str) -> Any:
    """A typer option for the trainer argument `key` (passed on as trl.KEY)."""
    return typer.Option(None, *flags, help=f"{help} (trl.{key})")


PROFILE = typer.Option("tiny", help="bundled profile (tiny | paper) or a YAML file with base/sft/dpo sections")
CONFIG = typer.Option(None, "--config", help="YAML overriding the profile (stage sections or a flat mapping)")
SET = typer.Option([], "--set", help="override a setting (--set batch_size=4) or a trainer argument "
                                     "(--set trl.optim=adafactor); repeatable")
OUT = option("out", ...)
MAX_STEPS = trainer_option("max_steps", "stop after this many optimiser steps (overrides epochs)")
EPOCHS = trainer_option("num_train_epochs", "training epochs")
LR = trainer_option("learning_rate", "peak learning rate", "--learning-rate")
BATCH = option("batch_size")
RESUME = option("resume", None, "--resume/--no-resume")
PROGRESS = option("progress", True, "--progress/--no-progress")
LORA = option("lora", None, "--lora/--no-lora", cls=SFTTrainConfig)
DTYPE = dtype_option(help_text(SFTTrainConfig, "dtype"))
CHECKPOINTING = option("gradient_checkpointing", None, "--gradient-checkpointing/--no-gradient-checkpointing",
                       cls=SFTTrainConfig)


def _run(stage: str, profile: str, config_file: Path | None, sets: list[str], **options: Any) -> None:
    """Build the stage's config, train, print a JSON summary."""
    from rolemrc.train.config import STAGE_CONFIGS, make_config, parse_overrides

    overrides = {**parse_overrides(sets), **{k: v for k, v in options.items() if v is not None}}
    config = make_config(STAGE_CONFIGS[stage], profile=profile, config_file=config_file, **overrides)
    result = _trainer(stage)(config)
    summary = {"stage": stage, "out": str(result.out_dir), "seconds": round(result.seconds, 1),
               "resumed_from": result.resumed_from, "data": {k: result.data[k] for k in ("kept", "skipped", "reasons")},
               "metrics": {k: round(v, 5) if isinstance(v, float) else v for k, v in result.metrics.items()}}
    typer.echo(json.dumps(summary, indent=1))


def given(ctx: typer.Context, name: str, value: Any) -> Any:
    """`value` where the command line gave option `name`, else None: a default leaves the profile's or --config's."""
    return None if ctx.get_parameter_source(name) is ParameterSource.DEFAULT else value


def trainer_overrides(max_steps: int | None, epochs: float | None, learning_rate: float | None) -> dict[str, Any]:
    """The trainer arguments every stage's command takes as options, as trl.KEY overrides."""
    return {"trl.max_steps": max_steps, "trl.num_train_epochs": epochs, "trl.learning_rate": learning_rate}


def _trainer(stage: str):
    from rolemrc import train

    return getattr(train, f"train_{stage}")


@app.command("base")
@needs("train")
def base_cmd(
    data: list[Path] = option("data", ..., cls=BaseTrainConfig),
    out: Path = OUT,
    profile: str = PROFILE,
    config: Path = CONFIG,
    set_: list[str] = SET,
    vocab_size: int = option("vocab_size", cls=BaseTrainConfig),
    max_steps: int = MAX_STEPS,
    epochs: float = EPOCHS,
    lr: float = LR,
    batch_size: int = BATCH,
    resume: bool = RESUME,
    progress: bool = PROGRESS,
) -> None:
    """Train a tokenizer and a small Llama from scratch on the chat-formatted data (test records held out)."""
    _run("base", profile, config, set_, data=[str(p) for p in data], out=str(out), vocab_size=vocab_size,
         batch_size=batch_size, resume=resume, progress=progress, **trainer_overrides(max_steps, epochs, lr))


@app.command("sft")
@needs("train")
def sft_cmd(
    ctx: typer.Context,
    model: Path = option("model", ..., cls=SFTTrainConfig),
    data: list[Path] = option("data", ..., cls=SFTTrainConfig),
    out: Path = OUT,
    mix: list[str] = option("mix", [], cls=SFTTrainConfig),
    lora: bool = LORA,
    dtype: Dtype = DTYPE,
    gradient_checkpointing: bool = CHECKPOINTING,
    profile: str = PROFILE,
    config: Path = CONFIG,
    set_: list[str] = SET,
    max_steps: int = MAX_STEPS,
    epochs: float = EPOCHS,
    lr: float = LR,
    batch_size: int = BATCH,
    resume: bool = RESUME,
    progress: bool = PROGRESS,
) -> None:
    """Supervised fine-tuning (trl SFTTrainer), loss on assistant turns only."""
    _run("sft", profile, config, set_, model=str(model), data=[str(p) for p in data], out=str(out),
         mix=list(mix) or None, lora=lora, dtype=given(ctx, "dtype", dtype),
         gradient_checkpointing=gradient_checkpointing, batch_size=batch_size, resume=resume, progress=progress,
         **trainer_overrides(max_steps, epochs, lr))


@app.command("dpo")
@needs("train")
def dpo_cmd(
    ctx: typer.Context,
    model: Path = option("model", ..., cls=DPOTrainConfig),
    data: list[Path] = option("data", ..., cls=DPOTrainConfig),
    out: Path = OUT,
    beta: float = trainer_option("beta", "DPO beta"),
    lora: bool = LORA,
    dtype: Dtype = DTYPE,
    gradient_checkpointing: bool = CHECKPOINTING,
    profile: str = PROFILE,
    config: Path = CONFIG,
    set_: list[str] = SET,
    max_steps: int = MAX_STEPS,
    epochs: float = EPOCHS,
    lr: float = LR,
    batch_size: int = BATCH,
    resume: bool = RESUME,
    progress: bool = PROGRESS,
) -> None:
    """Direct preference optimisation (trl DPOTrainer) from an SFT checkpoint."""
    _run("dpo", profile, config, set_, model=str(model), data=[str(p) for p in data], out=str(out), lora=lora,
         dtype=given(ctx, "dtype", dtype), gradient_checkpointing=gradient_checkpointing, batch_size=batch_size,
         resume=resume, progress=progress, **trainer_overrides(max_steps, epochs, lr), **{"trl.beta": beta})
