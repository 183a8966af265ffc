"""Training configs: rolemrc's own settings (trl-style dataclasses), plus trainer arguments passed to trl.

A profile (`train/profiles/<name>.yaml`, or any YAML path) has one section per stage (`base`, `sft`, `dpo`).
A section holds rolemrc's own settings (the dataclass fields below) and a `trl:` mapping of keyword
arguments for the stage's trainer arguments class (transformers' `TrainingArguments` for base, trl's
`SFTConfig` / `DPOConfig`): any field of that class is accepted, anything else is refused with close
matches. The config of a run is: defaults (the fields' and `TRL_DEFAULTS`) < profile section <
`--config` file (same layout, or a flat mapping for one stage) < explicit overrides; `trl:` mappings
merge key by key. Overrides name trainer arguments as `trl.KEY` (`--set trl.loss_type=ipo`).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from rolemrc.core.artifacts import expect
from rolemrc.core.errors import InputError, RolemrcError
from rolemrc.core.io import read_yaml
from rolemrc.core.placement import MODEL_HELP, check_dtype

PROFILE_DIR = Path(__file__).parent / "profiles"
STAGES = ("base", "sft", "dpo")


class TrainConfigError(RolemrcError, ValueError):
    """A config or profile is malformed (unknown key, wrong type, missing section)."""


# rolemrc's defaults for trainer arguments, all stages ("all") and per stage; a `trl:` entry overrides any.
TRL_DEFAULTS: dict[str, dict[str, Any]] = {
    "all": {"learning_rate": 2e-5, "lr_scheduler_type": "cosine", "warmup_steps": 0.0, "num_train_epochs": 1.0,
            "max_steps": -1, "weight_decay": 0.0, "max_grad_norm": 1.0, "logging_steps": 1,
            "logging_first_step": True, "save_strategy": "steps", "save_steps": 50, "save_total_limit": 2,
            "bf16": False,  # trl's default is on; half-precision weights (`dtype`) turn it on (runner.mixed_precision)
            "report_to": [], "dataloader_num_workers": 0},
    "base": {},
    "sft": {"max_length": 512, "assistant_only_loss": True, "packing": False},
    "dpo": {"max_length": 512, "beta": 0.1},
}

TRAIN_DTYPE_HELP = ("dtype the model trains at (with LoRA the frozen weights; peft keeps the adapters in float32). "
                    "auto: the checkpoint's own (config.json) on a GPU, float32 on the CPU, where bf16 training is "
                    "slow and rounds small updates away; float16 with LoRA only. The saved model is in the "
                    "checkpoint's dtype, whatever it trained at")
CHECKPOINTING_HELP = ("gradient (activation) checkpointing: recompute each layer's activations in the backward pass "
                      "instead of keeping them (unset: on on a GPU, off on the CPU, where it only slows small models)")


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def on_gpu(config: TrainConfig) -> bool:
    """Whether the trainer runs on a GPU: `--device auto`'s choice (a GPU when there is one), unless trl.use_cpu."""
    from rolemrc.core.modeling import resolve_device  # torch, on first use

    return not config.trl.get("use_cpu") and resolve_device("auto").type == "cuda"


def checkpointing(config: PrecisionOptions) -> bool:
    """Whether the trainer checkpoints activations: `gradient_checkpointing`, or (unset) on a GPU only."""
    return on_gpu(config) if config.gradient_checkpointing is None else config.gradient_checkpointing


def check_train_dtype(dtype: str, lora: bool, source: str = "dtype") -> None:
    """A TrainConfigError naming `source` for a dtype outside DTYPES, or float16 weights trained without LoRA: with
    full fine-tuning torch's GradScaler refuses float16 gradients ("Attempting to unscale FP16 gradients") and
    without loss scaling float16 gradients and AdamW's eps underflow."""
    try:
        check_dtype(dtype)
    except InputError as exc:
        raise TrainConfigError(f"{source}: {exc}") from None
    if dtype == "float16" and not lora:
        raise TrainConfigError(f"{source}: float16 weights train LoRA adapters only (peft keeps those in float32): full "
                               "fine-tuning of float16 weights has no loss scaling (torch's GradScaler refuses float16 "
                               "gradients); use bfloat16 or float32")


def checkpoints_dir(config: TrainConfig) -> Path:
    return Path(config.out) / "checkpoints"


def accumulation_steps(config: TrainConfig) -> int:
    """Gradient accumulation that makes batch_size x steps x processes equal effective_batch_size."""
    if config.effective_batch_size is None:
        return 1
    per_step = config.batch_size * world_size()
    if config.effective_batch_size % per_step:
        raise TrainConfigError(f"effective_batch_size {config.effective_batch_size} is not a multiple of batch_size "
                          f"{config.batch_size} x {world_size()} process(es)")
    return config.effective_batch_size // per_step


# Trainer arguments derived from rolemrc's own settings (so not accepted under `trl:`): argument -> (setting, value).
DERIVED: dict[str, tuple[str, Callable[[TrainConfig], Any]]] = {
    "output_dir": ("out", lambda c: str(checkpoints_dir(c))),
    "per_device_train_batch_size": ("batch_size", lambda c: c.batch_size),
    "gradient_accumulation_steps": ("effective_batch_size", accumulation_steps),
    "seed": ("seed", lambda c: c.seed),
    "disable_tqdm": ("progress", lambda c: not c.progress),
    "gradient_checkpointing": ("gradient_checkpointing", checkpointing),
}


def _suggest(key: str, candidates: Iterable[str], shown: Callable[[str], str] = str) -> str:
    close = difflib.get_close_matches(key, list(candidates), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(map(shown, close))}?" if close else ""


def _coerce(hint: Any, value: Any, name: str) -> Any:
    """Convert a YAML/CLI value to the type `hint` (YAML reads `2e-5` as a string); unions of several
    types are left to the class that receives the value."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if value is None and type(None) in typing.get_args(hint):
            return None
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(options) > 1:
            return value
        hint = options[0]
    target = typing.get_origin(hint) or hint
    try:
        if target is dict:
            if not isinstance(value, dict):
                raise ValueError
            return dict(value)
        if target is list:
            item = (typing.get_args(hint) or (str,))[0]
            items = value if isinstance(value, (list, tuple)) else [value]
            return [_coerce(item, v, name) for v in items]
        if target is bool:
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                return value.lower() in ("true", "1", "yes")
            if isinstance(value, bool):
                return value
            raise ValueError
        if target is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return target(value) if target in (int, float, str) else value
    except (TypeError, ValueError):
        shown = getattr(target, "__name__", None) or str(hint)
        raise TrainConfigError(f"{name}: cannot use {value!r} as {shown}") from None


@dataclass(kw_only=True)
class TrainConfig:
    """Settings every stage shares (batching, checkpoints, bad-record policy) and its trainer arguments."""

    stage: ClassVar[str]
    arguments: ClassVar[str]  # "module.Class" of the stage's trainer arguments

    out: str = field(metadata={"help": "output directory (a normal HF model directory with rolemrc.json)"})
    batch_size: int = field(default=8, metadata={"help": "per-device batch size"})
    effective_batch_size: int | None = field(default=None, metadata={
        "help": "batch_size x gradient accumulation x processes; accumulation is derived (unset: none)"})
    seed: int = field(default=0, metadata={"help": "seed for data order, mixing, model init and the trainer"})
    resume: bool = field(default=True, metadata={"help": "continue from the last checkpoint in OUT/checkpoints"})
    keep_checkpoints: bool = field(default=False, metadata={"help": "keep OUT/checkpoints after a successful run"})
    max_bad_share: float = field(default=0.1, metadata={"help": "fail when more than this share of records is bad"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    trl: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "keyword arguments for the stage's trainer arguments class (trl.KEY=VALUE)"})

    def __post_init__(self) -> None:
        self.trl = resolve_trl(type(self), self.trl)
        checks = (("learning_rate", self.trl["learning_rate"] > 0, "> 0"),
                  ("warmup_steps", self.trl["warmup_steps"] >= 0, ">= 0"),
                  ("batch_size", self.batch_size >= 1, ">= 1"),
                  ("max_bad_share", 0 <= self.max_bad_share <= 1, "in [0, 1]"))
        for name, ok, rule in checks:
            if not ok:
                raise TrainConfigError(f"{name} must be {rule}, got {self.trl.get(name, getattr(self, name, None))}")
        if self.effective_batch_size is not None and self.effective_batch_size < self.batch_size:
            raise TrainConfigError(f"effective_batch_size {self.effective_batch_size} < batch_size {self.batch_size}")
        if self.trl["max_steps"] <= 0 and self.trl["num_train_epochs"] <= 0:
            raise TrainConfigError("set max_steps > 0 or num_train_epochs > 0")

    @classmethod
    def arguments_class(cls) -> type:
        """The trainer arguments class (imported on first use: trl is slow to import)."""
        module, _, name = cls.arguments.rpartition(".")
        return getattr(importlib.import_module(module), name)


@dataclass(kw_only=True)
class LoraOptions:
    """LoRA via peft; adapters are merged into the weights when the model is saved."""

    lora: bool = field(default=False, metadata={"help": "train LoRA adapters (merged into the weights on save)"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha"})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout"})
    lora_target_modules: str = field(default="all-linear", metadata={
        "help": "peft target_modules: all-linear, a module name or regex, or names separated by commas"})


@dataclass(kw_only=True)
class PrecisionOptions:
    """The dtype a stage that starts from a checkpoint trains at, and activation memory. A mixin placed before
    TrainConfig (its checks run after TrainConfig's)."""

    dtype: str = field(default="auto", metadata={"help": TRAIN_DTYPE_HELP})
    gradient_checkpointing: bool | None = field(default=None, metadata={"help": CHECKPOINTING_HELP})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_train_dtype(self.dtype, self.lora)


@dataclass(kw_only=True)
class BaseTrainConfig(TrainConfig):
    """Tokenizer + Llama from scratch, pretrained on chat-formatted RoleMRC-style data."""

    stage = "base"
    arguments = "transformers.TrainingArguments"

    data: list[str] = field(metadata={"help": "RoleMRC JSONL files or directories of them"})
    vocab_size: int = field(default=2048, metadata={"help": "BPE vocabulary size"})
    hidden: int = field(default=256, metadata={"help": "hidden size"})
    layers: int = field(default=4, metadata={"help": "transformer layers"})
    intermediate: int = field(default=688, metadata={"help": "MLP size"})
    heads: int = field(default=4, metadata={"help": "attention heads"})
    kv_heads: int | None = field(default=None, metadata={"help": "key/value heads (unset: as many as heads)"})
    max_positions: int = field(default=1024, metadata={"help": "longest sequence the model supports"})
    block_size: int = field(default=256, metadata={"help": "packed sequence length for pretraining"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden % self.heads:
            raise TrainConfigError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.block_size > self.max_positions:
            raise TrainConfigError(f"block_size {self.block_size} > max_positions {self.max_positions}")


@dataclass(kw_only=True)
class SFTTrainConfig(PrecisionOptions, TrainConfig, LoraOptions):
    """trl SFTTrainer with loss on assistant turns only."""

    stage = "sft"
    arguments = "trl.SFTConfig"

    model: str = field(metadata={"help": f"model to fine-tune (e.g. the base model): {MODEL_HELP}"})
    data: list[str] = field(metadata={"help": "SFT JSONL (conversations; capitalised roles accepted)"})
    mix: list[str] = field(default_factory=list, metadata={
        "help": "PATH:RATIO adds RATIO x len(data) SFT records from PATH"})


@dataclass(kw_only=True)
class DPOTrainConfig(PrecisionOptions, TrainConfig, LoraOptions):
    """trl DPOTrainer from an SFT checkpoint against a frozen copy of it."""

    stage = "dpo"
    arguments = "trl.DPOConfig"

    model: str = field(metadata={"help": f"SFT model (also the frozen reference): {MODEL_HELP}"})
    data: list[str] = field(metadata={"help": "preference pairs JSONL (prompt, chosen, rejected)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.trl["beta"] <= 0:
            raise TrainConfigError(f"beta must be > 0, got {self.trl['beta']}")


STAGE_CONFIGS: dict[str, type[TrainConfig]] = {c.stage: c for c in (BaseTrainConfig, SFTTrainConfig, DPOTrainConfig)}
C = TypeVar("C", bound=TrainConfig)


def help_text(cls: type[TrainConfig], name: str) -> str:
    """The help of one of rolemrc's own settings (the one place their help texts live)."""
    return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name)


def resolve_trl(cls: type[TrainConfig], given: dict[str, Any]) -> dict[str, Any]:
    """rolemrc's defaults updated with `given`, each key checked against the stage's trainer arguments class
    and its value converted to the field's type."""
    args_cls = cls.arguments_class()
    fields = {f.name for f in dataclasses.fields(args_cls) if f.init}
    derived = derived_arguments(cls)
    for key in given:
        if key in derived:
            raise TrainConfigError(f"trl.{key} is derived from rolemrc's `{DERIVED[key][0]}` setting; set that instead")
        if key not in fields:
            raise TrainConfigError(f"unknown {cls.stage} trainer argument trl.{key} ({args_cls.__name__} has no such field)"
                              + _suggest(key, fields - set(derived)))
    hints = typing.get_type_hints(args_cls)
    values = {**TRL_DEFAULTS["all"], **TRL_DEFAULTS[cls.stage], **given}
    return {key: _coerce(hints[key], value, f"{args_cls.__name__}.{key}") for key, value in values.items()}


def derived_arguments(cls: type[TrainConfig]) -> set[str]:
    """The trainer arguments DERIVED from settings the stage `cls` has (so not accepted under `trl:`)."""
    own = {f.name for f in dataclasses.fields(cls)}
    return {key for key, (setting, _) in DERIVED.items() if setting in own}


def trl_arguments(config: TrainConfig) -> dict[str, Any]:
    """The config's `trl` entries, then the trainer arguments rolemrc derives from its own settings."""
    derived = derived_arguments(type(config))
    return {**config.trl, **{key: value(config) for key, (_, value) in DERIVED.items() if key in derived}}


def profile_path(profile: str | os.PathLike) -> Path:
    """A bundled profile name (`tiny`, `paper`) or a path to a YAML file."""
    path = Path(profile)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise TrainConfigError(f"{path}: no such profile file")
        return path
    bundled = PROFILE_DIR / f"{profile}.yaml"
    if not bundled.is_file():
        names = sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))
        raise TrainConfigError(f"unknown profile {str(profile)!r}; bundled profiles: {names}, or pass a .yaml path")
    return bundled


def _read_yaml(path: Path) -> dict[str, Any]:
    data = read_yaml(path, TrainConfigError, "config file") or {}
    if not isinstance(data, dict):
        raise TrainConfigError(f"{path}: expected a mapping at the top level")
    return data


def stage_section(path: Path, stage: str, *, required: bool) -> dict[str, Any]:
    """The `stage` section of a YAML file; a file without any stage section counts as flat."""
    data = _read_yaml(path)
    if not any(key in STAGES for key in data):
        return data
    section = data.get(stage)
    if section is None:
        if required:
            raise TrainConfigError(f"{path}: no '{stage}' section (has: {', '.join(k for k in data if k in STAGES)})")
        return {}
    if not isinstance(section, dict):
        raise TrainConfigError(f"{path}: section '{stage}' must be a mapping")
    return section


def split_layer(cls: type[TrainConfig], layer: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(own settings, trainer arguments) of one layer: `trl:` mappings and `trl.KEY` go to the second."""
    own_fields = {f.name for f in dataclasses.fields(cls)} - {"trl"}
    own: dict[str, Any] = {}
    trl: dict[str, Any] = {}
    for key, value in layer.items():
        if key == "trl":
            if not isinstance(value, dict):
                raise TrainConfigError(f"{cls.stage}: `trl` must be a mapping of trainer arguments, got {value!r}")
            trl.update(value)
        elif key.startswith("trl."):
            trl[key.removeprefix("trl.")] = value
        elif key in own_fields:
            own[key] = value
        else:
            argument = {f.name for f in dataclasses.fields(cls.arguments_class())}
            hint = (f"; {key} is a trainer argument: write it under `trl:` (--set trl.{key}=...)" if key in argument
                    else _suggest(key, own_fields | argument, lambda n: n if n in own_fields else f"trl.{n}"))
            raise TrainConfigError(f"unknown {cls.stage} setting {key!r}{hint}")
    return own, trl


def make_config(cls: type[C], *, profile: str | os.PathLike | None = "tiny",
                config_file: str | os.PathLike | None = None, **overrides: Any) -> C:
    """Build a `cls` config: profile section, then config file, then keyword overrides (None = not set)."""
    layers = []
    if profile is not None:
        layers.append(stage_section(profile_path(profile), cls.stage, required=True))
    if config_file is not None:
        path = Path(config_file)
        try:
            expect(path, ("train-config", "yaml", "json", "text", "binary", "non-utf8"),
                   "expected a training config (a YAML of settings, flat or in base/sft/dpo sections)")
        except InputError as exc:
            raise TrainConfigError(str(exc)) from None
        section = stage_section(path, cls.stage, required=False)
        try:
            split_layer(cls, section)   # an unknown setting is named with its file
        except TrainConfigError as exc:
            raise TrainConfigError(f"{path}: {exc}") from None
        layers.append(section)
    layers.append({k: v for k, v in overrides.items() if v is not None})
    own: dict[str, Any] = {}
    trl: dict[str, Any] = {}
    for layer in layers:
        layer_own, layer_trl = split_layer(cls, layer)
        own.update(layer_own)
        trl.update(layer_trl)
    missing = sorted(f.name for f in dataclasses.fields(cls)
                     if f.name not in own and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if missing:
        raise TrainConfigError(f"{cls.stage}: missing required setting(s) {missing}")
    hints = typing.get_type_hints(cls)
    return cls(**{k: _coerce(hints[k], v, f"{cls.__name__}.{k}") for k, v in own.items()}, trl=trl)


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`key=value` strings (values parsed as YAML scalars) from `--set`; `trl.KEY` names a trainer argument."""
    import yaml

    out = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise TrainConfigError(f"--set expects key=value, got {pair!r}")
        out[key.strip().replace("-", "_")] = yaml.safe_load(raw) if raw else ""
    return out
