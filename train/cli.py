"""`rolemrc train base|sft|dpo`. Settings: profile < --config YAML < --set key=value < explicit options.

Multi-GPU: `accelerate launch --num_processes 8 $(which rolemrc) train sft ...` runs unchanged;
gradient accumulation is derived so that the effective batch stays as configured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

app = typer.Typer(no_args_is_help=True, help="Train the embedded base model, then SFT and DPO (trl).")

PROFILE = typer.Option("tiny", help="bundled profile (tiny | paper) or a YAML file with base/sft/dpo sections")
CONFIG = typer.Option(None, "--config", help="YAML overriding the profile (stage sections or a flat mapping)")
SET = typer.Option([], "--set", help="override any setting: --set learning_rate=1e-4 (repeatable)")
OUT = typer.Option(..., help="output directory (a normal HF model directory with rolemrc.json)")
MAX_STEPS = typer.Option(None, help="stop after this many optimiser steps (overrides epochs)")
EPOCHS = typer.Option(None, help="training epochs")
LR = typer.Option(None, help="learning rate")
BATCH = typer.Option(None, help="per-device batch size")
RESUME = typer.Option(None, "--resume/--no-resume", help="continue from the last checkpoint in OUT/checkpoints")
PROGRESS = typer.Option(True, "--progress/--no-progress", help="show a progress bar")
LORA = typer.Option(None, "--lora/--no-lora", help="train LoRA adapters (merged into the weights on save)")


def _run(stage: str, profile: str, config_file: Path | None, sets: list[str], **options: Any) -> None:
    """Build the stage's config, train, print a JSON summary; config/data problems exit with code 2."""
    from rolemrc.core.io import JsonlError
    from rolemrc.train.config import STAGE_CONFIGS, ConfigError, make_config, parse_overrides
    from rolemrc.train.data import DataError

    try:
        overrides = {**parse_overrides(sets), **{k: v for k, v in options.items() if v is not None}}
        config = make_config(STAGE_CONFIGS[stage], profile=profile, config_file=config_file, **overrides)
        train = _trainer(stage)
        result = train(config)
    except (ConfigError, DataError, JsonlError) as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(2) from None
    summary = {"stage": stage, "out": str(result.out_dir), "seconds": round(result.seconds, 1),
               "resumed_from": result.resumed_from, "data": {k: result.data[k] for k in ("kept", "skipped", "reasons")},
               "metrics": {k: round(v, 5) if isinstance(v, float) else v for k, v in result.metrics.items()}}
    typer.echo(json.dumps(summary, indent=1))


def _trainer(stage: str):
    from rolemrc import train

    return getattr(train, f"train_{stage}")


@app.command("base")
def base_cmd(
    data: list[Path] = typer.Option(..., help="RoleMRC JSONL files or directories of them (repeatable)"),
    out: Path = OUT,
    profile: str = PROFILE,
    config: Path = CONFIG,
    set_: list[str] = SET,
    vocab_size: int = typer.Option(None, help="BPE vocabulary size"),
    max_steps: int = MAX_STEPS,
    epochs: float = EPOCHS,
    lr: float = LR,
    batch_size: int = BATCH,
    resume: bool = RESUME,
    progress: bool = PROGRESS,
) -> None:
    """Train a tokenizer and a small Llama from scratch on the chat-formatted data (test records held out)."""
    _run("base", profile, config, set_, data=[str(p) for p in data], out=str(out), vocab_size=vocab_size,
         max_steps=max_steps, num_train_epochs=epochs, learning_rate=lr, batch_size=batch_size, resume=resume,
         progress=progress)


@app.command("sft")
def sft_cmd(
    model: Path = typer.Option(..., help="model directory to fine-tune (e.g. the base model)"),
    data: list[Path] = typer.Option(..., help="SFT JSONL (conversations; capitalised roles accepted)"),
    out: Path = OUT,
    mix: list[str] = typer.Option([], help="PATH:RATIO adds RATIO x len(data) SFT records from PATH (repeatable)"),
    lora: bool = LORA,
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
         mix=list(mix) or None, lora=lora, max_steps=max_steps, num_train_epochs=epochs, learning_rate=lr,
         batch_size=batch_size, resume=resume, progress=progress)


@app.command("dpo")
def dpo_cmd(
    model: Path = typer.Option(..., help="SFT model directory (also the frozen reference)"),
    data: list[Path] = typer.Option(..., help="preference pairs JSONL (prompt, chosen, rejected)"),
    out: Path = OUT,
    beta: float = typer.Option(None, help="DPO beta"),
    lora: bool = LORA,
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
    _run("dpo", profile, config, set_, model=str(model), data=[str(p) for p in data], out=str(out), beta=beta,
         lora=lora, max_steps=max_steps, num_train_epochs=epochs, learning_rate=lr, batch_size=batch_size,
         resume=resume, progress=progress)
