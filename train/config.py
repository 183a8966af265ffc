"""Training configs (trl-style dataclasses) and YAML profiles with overrides.

A profile (`train/profiles/<name>.yaml`, or any YAML path) has one section per stage
(`base`, `sft`, `dpo`). The config of a run is: dataclass defaults < profile section <
`--config` file (same layout, or a flat mapping for one stage) < explicit overrides.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rolemrc.core.io import read_yaml

PROFILE_DIR = Path(__file__).parent / "profiles"
STAGES = ("base", "sft", "dpo")


class ConfigError(ValueError):
    """A config or profile is malformed (unknown key, wrong type, missing section)."""


@dataclass(kw_only=True)
class TrainConfig:
    """Settings every stage shares (optimiser, schedule, batching, checkpoints, bad-record policy)."""

    out: str
    learning_rate: float = 2e-5
    lr_scheduler_type: str = "cosine"
    warmup_ratio: float = 0.0
    num_train_epochs: float = 1.0
    max_steps: int = -1  # > 0 overrides num_train_epochs
    batch_size: int = 8  # per device
    effective_batch_size: int | None = None  # batch_size x accumulation x processes; None = no accumulation
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_length: int = 512
    seed: int = 0
    logging_steps: int = 1
    save_steps: int = 50
    save_total_limit: int = 2
    resume: bool = True  # continue from the last checkpoint under out/checkpoints if there is one
    keep_checkpoints: bool = False  # keep out/checkpoints after a successful run
    bf16: bool = False
    gradient_checkpointing: bool = False  # trades compute for memory (off: it only slows small models down)
    max_bad_share: float = 0.1  # fail when more than this share of records is bad
    progress: bool = True

    def __post_init__(self) -> None:
        if self.learning_rate <= 0:
            raise ConfigError(f"learning_rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.effective_batch_size is not None and self.effective_batch_size < self.batch_size:
            raise ConfigError(f"effective_batch_size {self.effective_batch_size} < batch_size {self.batch_size}")
        if not 0 <= self.max_bad_share <= 1:
            raise ConfigError(f"max_bad_share must be in [0, 1], got {self.max_bad_share}")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise ConfigError("set max_steps > 0 or num_train_epochs > 0")


@dataclass(kw_only=True)
class LoraOptions:
    """LoRA via peft; adapters are merged into the weights when the model is saved."""

    lora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: str = "all-linear"


@dataclass(kw_only=True)
class BaseTrainConfig(TrainConfig):
    """Tokenizer + Llama from scratch, pretrained on chat-formatted RoleMRC-style data."""

    data: list[str]
    vocab_size: int = 2048
    hidden: int = 256
    layers: int = 4
    intermediate: int = 688
    heads: int = 4
    kv_heads: int | None = None
    max_positions: int = 1024
    block_size: int = 256  # packed sequence length for pretraining

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden % self.heads:
            raise ConfigError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.block_size > self.max_positions:
            raise ConfigError(f"block_size {self.block_size} > max_positions {self.max_positions}")


@dataclass(kw_only=True)
class SFTTrainConfig(TrainConfig, LoraOptions):
    """trl SFTTrainer with loss on assistant turns only."""

    model: str
    data: list[str]
    mix: list[str] = field(default_factory=list)  # "PATH:RATIO", RATIO x len(data) records drawn from PATH


@dataclass(kw_only=True)
class DPOTrainConfig(TrainConfig, LoraOptions):
    """trl DPOTrainer from an SFT checkpoint against a frozen copy of it."""

    model: str
    data: list[str]
    beta: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta <= 0:
            raise ConfigError(f"beta must be > 0, got {self.beta}")


STAGE_CONFIGS: dict[str, type[TrainConfig]] = {"base": BaseTrainConfig, "sft": SFTTrainConfig, "dpo": DPOTrainConfig}
C = TypeVar("C", bound=TrainConfig)


def profile_path(profile: str | os.PathLike) -> Path:
    """A bundled profile name (`tiny`, `paper`) or a path to a YAML file."""
    path = Path(profile)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"{path}: no such profile file")
        return path
    bundled = PROFILE_DIR / f"{profile}.yaml"
    if not bundled.is_file():
        names = sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown profile {str(profile)!r}; bundled profiles: {names}, or pass a .yaml path")
    return bundled


def _read_yaml(path: Path) -> dict[str, Any]:
    data = read_yaml(path, ConfigError, "config file") or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def stage_section(path: Path, stage: str, *, required: bool) -> dict[str, Any]:
    """The `stage` section of a YAML file; a file without any stage section counts as flat."""
    data = _read_yaml(path)
    if not any(key in STAGES for key in data):
        return data
    section = data.get(stage)
    if section is None:
        if required:
            raise ConfigError(f"{path}: no '{stage}' section (has: {', '.join(k for k in data if k in STAGES)})")
        return {}
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: section '{stage}' must be a mapping")
    return section


def _coerce(cls: type, name: str, value: Any) -> Any:
    """Convert YAML/CLI values to the field's type (YAML reads `2e-5` as a string)."""
    hint = typing.get_type_hints(cls)[name]
    optional = isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint)
    if optional:
        if value is None:
            return None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    target = typing.get_origin(hint) or hint
    try:
        if target is list:
            return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
        if target is bool:
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                return value.lower() in ("true", "1", "yes")
            if isinstance(value, bool):
                return value
            raise ValueError
        if target is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return target(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{cls.__name__}.{name}: cannot use {value!r} as {getattr(target, '__name__', target)}") from None


def make_config(cls: type[C], *, profile: str | os.PathLike | None = "tiny", config_file: str | os.PathLike | None = None,
                **overrides: Any) -> C:
    """Build a `cls` config: profile section, then config file, then keyword overrides (None = not set)."""
    stage = next(s for s, c in STAGE_CONFIGS.items() if c is cls)
    values: dict[str, Any] = {}
    if profile is not None:
        values.update(stage_section(profile_path(profile), stage, required=True))
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"{path}: no such config file")
        values.update(stage_section(path, stage, required=False))
    values.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown {stage} setting(s) {unknown}; valid: {sorted(known)}")
    missing = sorted(f.name for f in dataclasses.fields(cls)
                     if f.name not in values and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if missing:
        raise ConfigError(f"{stage}: missing required setting(s) {missing}")
    return cls(**{k: _coerce(cls, k, v) for k, v in values.items()})


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`key=value` strings (values parsed as YAML scalars) from `--set`."""
    import yaml

    out = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects key=value, got {pair!r}")
        out[key.strip().replace("-", "_")] = yaml.safe_load(raw) if raw else ""
    return out
