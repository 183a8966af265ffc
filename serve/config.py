"""The server's YAML config: models, registered restraints, limits, keys, the A/B database."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from rolemrc.core.io import read_yaml

ENGINES = ("transformers", "vllm", "upstream")


class ConfigError(ValueError):
    """The serve config is malformed."""


@dataclass
class ModelConfig:
    """One servable model. `path`: a local HF directory (transformers; vllm: a baked checkpoint);
    `base_url`: an OpenAI-compatible endpoint (upstream)."""

    path: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    engine: str = "transformers"
    base_url: str | None = None
    upstream_model: str | None = None   # the model id the upstream knows (default: this entry's name)
    api_key_env: str | None = None      # env var holding the upstream's key
    pass_restraints: bool = False       # upstream: forward `restraint` (the upstream is a rolemrc server)
    vllm_args: list[str] = field(default_factory=list)

    def check(self, name: str) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"model {name!r}: unknown engine {self.engine!r}; choose one of {ENGINES}")
        if self.engine == "upstream" and not self.base_url:
            raise ConfigError(f"model {name!r}: engine 'upstream' needs base_url")
        if self.engine != "upstream" and not self.path:
            raise ConfigError(f"model {name!r}: engine {self.engine!r} needs path")
        if "+" in name:
            raise ConfigError(f"model name {name!r} must not contain '+' (it separates model and restraint)")


@dataclass
class ServeConfig:
    """Everything `rolemrc serve` needs; relative paths are resolved against the config file's folder."""

    models: dict[str, ModelConfig]
    restraints: dict[str, str] = field(default_factory=dict)   # name -> spec file
    allow_inline_restraints: bool = False
    max_inline_units: int = 4096
    api_key_env: str | None = None      # env var with one key or a comma-separated list
    api_key_file: str | None = None     # one key per line
    max_body_bytes: int = 1 << 20
    request_timeout_s: float = 120.0
    max_queue: int = 256                # requests admitted (waiting + generating) per model
    max_batch: int = 16
    max_new_tokens: int = 512           # cap on max_tokens
    default_max_tokens: int = 128
    db: str | None = "ab.sqlite"
    cors_origins: list[str] = field(default_factory=list)   # empty: CORS off
    drain_timeout_s: float = 30.0
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.models:
            raise ConfigError("config needs at least one entry under 'models'")
        for name, model in self.models.items():
            model.check(name)
        for key in ("max_inline_units", "max_body_bytes", "max_queue", "max_batch", "max_new_tokens",
                    "default_max_tokens"):
            if int(getattr(self, key)) < 1:
                raise ConfigError(f"{key} must be >= 1")
        if self.request_timeout_s <= 0:
            raise ConfigError("request_timeout_s must be > 0")

    @classmethod
    def from_dict(cls, data: dict[str, Any], base_dir: str | os.PathLike = ".") -> ServeConfig:
        if not isinstance(data, dict):
            raise ConfigError("the serve config must be a mapping")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown config field(s) {sorted(unknown)}")
        base = Path(base_dir)
        data = dict(data)
        models = {}
        model_fields = {f.name for f in fields(ModelConfig)}
        for name, entry in (data.pop("models", None) or {}).items():
            entry = {"path": entry} if isinstance(entry, str) else dict(entry or {})
            bad = set(entry) - model_fields
            if bad:
                raise ConfigError(f"model {name!r}: unknown field(s) {sorted(bad)}")
            if entry.get("path"):
                entry["path"] = str(_resolve(base, entry["path"]))
            models[str(name)] = ModelConfig(**entry)
        restraints = {str(k): str(_resolve(base, v)) for k, v in (data.pop("restraints", None) or {}).items()}
        for key in ("api_key_file", "db"):
            if data.get(key):
                data[key] = str(_resolve(base, data[key]))
        return cls(models=models, restraints=restraints, **data)

    @classmethod
    def load(cls, path: str | os.PathLike) -> ServeConfig:
        path = Path(path)
        return cls.from_dict(read_yaml(path, ConfigError, "config file"), path.parent)

    def api_keys(self) -> set[str]:
        """Keys accepted in `Authorization: Bearer`; empty means no auth."""
        keys: set[str] = set()
        if self.api_key_env:
            value = os.environ.get(self.api_key_env)
            if not value:
                raise ConfigError(f"api_key_env {self.api_key_env!r} is set in the config but empty in the environment")
            keys |= {k.strip() for k in value.split(",") if k.strip()}
        if self.api_key_file:
            keys |= {line.strip() for line in Path(self.api_key_file).read_text().splitlines() if line.strip()}
        return keys


def _resolve(base: Path, value: str) -> Path:
    path = Path(os.path.expanduser(str(value)))
    return path if path.is_absolute() else (base / path).resolve()
