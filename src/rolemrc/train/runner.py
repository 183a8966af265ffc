"""What every stage shares around a Trainer: arguments, resume, progress, final save, manifest."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from rolemrc.core.modeling import checkpoint_dtype, dir_fingerprint, resolve_dtype, resolve_model
from rolemrc.core.version import __version__
from rolemrc.train.config import (
    PrecisionOptions,
    TrainConfig,
    TrainConfigError,
    check_train_dtype,
    checkpoints_dir,
    on_gpu,
    trl_arguments,
    world_size,
)
from rolemrc.train.data import DataReport

MANIFEST = "rolemrc.json"
# Logged values summarised as first/last in the result metrics, when a stage logs them.
TRACKED = ("loss", "mean_token_accuracy", "rewards/margins", "rewards/accuracies", "rewards/chosen", "rewards/rejected")


@dataclass
class TrainResult:
    """A finished stage: where the model is and how training went."""

    stage: str
    out_dir: Path
    metrics: dict[str, float]
    history: list[dict[str, float]]
    data: dict[str, Any]
    resumed_from: str | None
    seconds: float

    @property
    def manifest(self) -> Path:
        return self.out_dir / MANIFEST


def resume_checkpoint(config: TrainConfig) -> str | None:
    """The last `checkpoint-N` under out/checkpoints when resuming is on, else None."""
    from transformers.trainer_utils import get_last_checkpoint

    folder = checkpoints_dir(config)
    if not config.resume or not folder.is_dir():
        return None
    return get_last_checkpoint(str(folder))


def train_dtype(config: PrecisionOptions) -> str:
    """The dtype the start model is loaded and trained at: `config.dtype`; for auto, the checkpoint's own on a GPU
    (`core.modeling.checkpoint_dtype`, as `--dtype auto` everywhere) and float32 on the CPU."""
    if config.dtype != "auto":
        return config.dtype
    if not on_gpu(config):
        return "float32"
    dtype = checkpoint_dtype(resolve_model(config.model))
    check_train_dtype(dtype, config.lora, f"dtype auto ({config.model} is stored in {dtype}; this runs on a GPU)")
    return dtype


def dtypes(config: TrainConfig) -> dict[str, str]:
    """What a stage that starts from a checkpoint trains at and saves at (the checkpoint's own dtype, whatever it
    trained at); empty for the base stage (trained and saved in float32)."""
    if not isinstance(config, PrecisionOptions):
        return {}
    return {"trained": train_dtype(config), "saved": checkpoint_dtype(resolve_model(config.model))}


def mixed_precision(config: TrainConfig) -> dict[str, bool]:
    """trl's autocast flags for the weights' dtype: bfloat16 weights train under bf16 autocast, float16 ones (LoRA
    only: peft keeps the adapters in float32) under fp16 with loss scaling; float32 weights under what trl.bf16 and
    trl.fp16 say (default: neither). A flag for the other half precision is refused."""
    dtype = train_dtype(config) if isinstance(config, PrecisionOptions) else "float32"
    if dtype == "float32":
        return {}
    flags = {"bf16": dtype == "bfloat16", "fp16": dtype == "float16"}
    for key, on in flags.items():
        if config.trl.get(key) and not on:
            raise TrainConfigError(f"trl.{key} autocasts {dtype} weights (dtype {config.dtype}) to the other half "
                                   "precision; drop it: half-precision weights train under their own")
    return flags


def trainer_arguments(config: TrainConfig) -> dict[str, Any]:
    """Keyword arguments for the stage's trainer arguments class: machine-dependent defaults, then the
    config's trainer arguments (`config.trl`, those derived from its own settings, the autocast its dtype needs)."""
    args = {**trl_arguments(config), **mixed_precision(config)}
    cpu = not torch.cuda.is_available()
    return {
        "dataloader_pin_memory": not cpu,
        # transformers runs data-parallel over CPU processes (gloo), and bf16 autocast on a CPU, only when told to
        # use the CPU
        "use_cpu": cpu and (world_size() > 1 or args["bf16"]),
        **args,
    }


def build_arguments(config: TrainConfig):
    """The stage's trainer arguments object; a value transformers or trl refuses is a TrainConfigError."""
    cls = config.arguments_class()
    arguments = trainer_arguments(config)
    try:
        return cls(**arguments)
    except (TypeError, ValueError) as exc:
        raise TrainConfigError(f"{cls.__name__}: {exc}") from None


class LossBar(ProgressCallback):
    """The Trainer's tqdm bar, with the latest loss (and DPO margin) as a postfix instead of printed dicts."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs:
            shown = {k.split("/")[-1]: f"{logs[k]:.4g}" for k in ("loss", "rewards/margins") if k in logs}
            if shown:
                self.training_bar.set_postfix(shown, refresh=False)


def prepare(trainer, config: TrainConfig, callbacks: tuple[TrainerCallback, ...] = ()) -> None:
    """Swap the Trainer's printing callbacks for the quiet progress bar (or nothing); add user callbacks."""
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    if config.progress:
        trainer.add_callback(LossBar())
    for callback in callbacks:
        trainer.add_callback(callback)


def summarise(history: list[dict[str, float]], train_metrics: dict[str, float], steps: int) -> dict[str, float]:
    metrics: dict[str, float] = {"steps": steps}
    for key in TRACKED:
        values = [h[key] for h in history if key in h]
        if values:
            metrics[f"first_{key}"], metrics[f"last_{key}"] = values[0], values[-1]
    metrics.update({k: v for k, v in train_metrics.items() if isinstance(v, (int, float))})
    return metrics


def source_model(model: str | os.PathLike) -> dict[str, Any]:
    """The model a stage starts from as named (a path, a pulled model's name, a hub id), the directory it resolved
    to, its fingerprint and (if it has a manifest) stage."""
    path = resolve_model(model)
    info: dict[str, Any] = {"path": str(model), "model_dir": str(path), "fingerprint": dir_fingerprint(path)}
    if (path / MANIFEST).is_file():
        info["stage"] = json.loads((path / MANIFEST).read_text()).get("stage")
    return info


def write_manifest(result: TrainResult, config: TrainConfig, extra: dict[str, Any]) -> None:
    manifest = {
        "stage": result.stage,
        "toolkit_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **extra,
        "config": dataclasses.asdict(config),
        "trainer_arguments": trainer_arguments(config),
        "metrics": result.metrics,
        "data_report": result.data,
        "resumed_from": result.resumed_from,
        "seconds": round(result.seconds, 2),
        "history": result.history,
    }
    tmp = result.manifest.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, result.manifest)


def save_final(trainer, out: Path, dtype: str) -> None:
    """Save a plain HF directory (LoRA adapters merged into the weights) with the tokenizer, its weights in `dtype`."""
    from peft import PeftModel

    model = trainer.accelerator.unwrap_model(trainer.model)
    if isinstance(model, PeftModel):
        if trainer.is_world_process_zero():
            model.merge_and_unload().to(resolve_dtype(dtype)).save_pretrained(out)
            trainer.processing_class.save_pretrained(out)
    else:
        model.to(resolve_dtype(dtype))
        trainer.save_model(str(out))


def train_and_save(trainer, config: TrainConfig, *, stage: str, report: DataReport,
                   manifest: dict[str, Any]) -> TrainResult:
    """Train (resuming from the last checkpoint if there is one), save the model and its manifest."""
    resumed_from = resume_checkpoint(config)
    started = time.perf_counter()
    output = trainer.train(resume_from_checkpoint=resumed_from)
    out = Path(config.out)
    precision = dtypes(config)
    save_final(trainer, out, precision.get("saved", "float32"))
    history = [{k: v for k, v in h.items() if isinstance(v, (int, float))}
               for h in trainer.state.log_history if "loss" in h]
    result = TrainResult(stage=stage, out_dir=out, metrics=summarise(history, output.metrics, trainer.state.global_step),
                         history=history, data=report.as_dict(), resumed_from=resumed_from,
                         seconds=time.perf_counter() - started)
    if trainer.is_world_process_zero():
        write_manifest(result, config, {**manifest, **({"dtype": precision} if precision else {})})
        if not config.keep_checkpoints:
            shutil.rmtree(checkpoints_dir(config), ignore_errors=True)
    return result


def start_model(config: PrecisionOptions):
    """(model, tokenizer) a stage starts from (`config.model`, a model name: `resolve_model`), in train mode, at
    `train_dtype(config)`, on the CPU (the trainer moves it); the tokenizer must have a chat template."""
    from rolemrc.core.modeling import load_model

    model, tokenizer = load_model(config.model, dtype=train_dtype(config), device="cpu")
    if not getattr(tokenizer, "chat_template", None):
        raise TrainConfigError(f"{config.model}: the tokenizer has no chat_template; SFT/DPO need one "
                          "(the embedded base model has one; set tokenizer.chat_template for others)")
    return model.train(), tokenizer


def lora_config(config):
    """peft LoraConfig for configs with `lora` on, else None."""
    if not config.lora:
        return None
    from peft import LoraConfig

    targets = config.lora_target_modules   # "all-linear", a module name or regex, or a comma-separated list of names
    if "," in targets:
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    return LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=targets, task_type="CAUSAL_LM")
