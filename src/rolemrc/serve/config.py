"""The server's YAML config: models, registered restraints, limits, keys, the A/B database."""

from __future__ import annotations

import ipaddress
import json
import os
import re
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from rolemrc.core.artifacts import expect
from rolemrc.core.errors import InputError
from rolemrc.core.hub import looks_like_path
from rolemrc.core.io import pulled_models, read_yaml
from rolemrc.serve.engines import ENGINES, engine_class
from rolemrc.serve.errors import ServeConfigError
from rolemrc.serve.store import is_url

T = TypeVar("T")

Role = Literal["serve", "admin"]   # serve: completions, models, reading restraints; admin: also changing them, experiments
ROLES: tuple[Role, ...] = get_args(Role)
LogLevel = Literal["critical", "error", "warning", "info", "debug"]
DEFAULT_MAX_TOKENS = 128
OnEngineDead = Literal["serve_others", "exit"]
_HOSTNAME = re.compile(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*")


@dataclass
class ModelConfig:
    """One servable model: the engine serving it (a name in `ENGINES`) and that engine's options."""

    engine: str
    options: Any

    @classmethod
    def parse(cls, name: str, entry: str | dict[str, Any] | None, base: Path, engine: str | None = None) -> ModelConfig:
        """A model entry as users write it: a path, or flat keys with `engine:` picking whose options the rest are
        (`engine`, when given, overrides it). Paths are resolved against `base`."""
        where = f"model {name!r}"
        entry = {"path": entry} if isinstance(entry, str) else dict(entry or {})
        written = entry.pop("engine", "transformers")
        engine = engine or written
        if engine not in ENGINES:
            raise ServeConfigError(f"{where}: unknown engine {engine!r}; choose one of {tuple(ENGINES)}")
        options = engine_class(engine).Options
        allowed = {f.name: f for f in fields(options)}
        unknown = sorted(set(entry) - set(allowed))
        if unknown:
            raise ServeConfigError(f"{where}: unknown key(s) {unknown} for engine {engine!r}; its keys: "
                              f"{['engine', *allowed]}")
        for key, f in allowed.items():
            if f.default is MISSING and f.default_factory is MISSING and not entry.get(key):
                raise ServeConfigError(f"{where}: engine {engine!r} needs {key}")
            if f.metadata.get("model_dir") and entry.get(key):
                entry[key] = str(_model_dir(where, base, entry[key]))
            elif f.metadata.get("local_path") and entry.get(key):
                entry[key] = str(_resolve(base, entry[key]))
        try:
            made = options(**entry)
        except ServeConfigError as exc:
            raise ServeConfigError(f"{where}: {exc}") from None
        return cls(engine, check_choices(made, where))

    def preflight(self, name: str) -> None:
        """ServeConfigError unless its model directories hold models and its engine's environment can serve."""
        for f in fields(self.options):
            if f.metadata.get("model_dir"):
                check_model_dir(f"model {name!r}: {f.name}", getattr(self.options, f.name))
        preflight = getattr(engine_class(self.engine), "preflight", None)
        if preflight is not None:
            preflight(name, self.options)

    def directories(self) -> list[str]:
        """The model directories its options name (the ones checked before serving)."""
        return [value for f in fields(self.options) if f.metadata.get("model_dir")
                and (value := getattr(self.options, f.name))]


@dataclass
class ServeConfig:
    """Everything `rolemrc serve` needs; relative paths are resolved against the config file's folder."""

    models: dict[str, ModelConfig]
    restraints: dict[str, str] = field(default_factory=dict)   # name -> spec file
    allow_inline_restraints: bool = False
    strict_restraints: bool = False     # refuse a registered restraint selected on another model (default: a warning)
    max_inline_units: int = 4096
    max_registered_restraints: int = 256   # restraints registered while serving (POST /v1/restraints), at most
    api_key_env: str | None = None      # env var with a comma-separated list of KEY or KEY:admin
    api_key_file: str | None = None     # one KEY or `KEY admin` per line; `#` starts a comment line
    allow_no_auth: bool = False         # no keys: true makes every caller admin and lets a non-loopback host serve;
                                        # false serves a loopback host only, its admin routes 403 admin_needs_keys
    allowed_hosts: list[str] | None = None   # Host names served besides loopback ones (any port; `*.x.org`, `*`);
                                        # None: loopback names only on a loopback host, any name elsewhere
    public_health_details: bool = False   # /health lists models and engines without an admin key
    public_metrics: bool = False        # /metrics without a key
    max_body_bytes: int = 1 << 20
    request_timeout_s: float = 120.0
    max_queue: int = 256                # requests admitted (waiting + generating) per model
    max_batch: int = 16
    max_new_tokens: int = 512           # cap on max_tokens
    default_max_tokens: int | None = None   # max_tokens when the client sends none; None: min(128, max_new_tokens)
    max_stop_strings: int = 4
    max_stop_chars: int = 256           # per stop string
    max_choices: int = 64               # prompts x n per request
    max_metadata_bytes: int = 8192      # the JSON of `metadata`
    max_queue_per_key: int = 64         # choices one API key (or client address) may have admitted per model
    db: str | None = "ab.sqlite"
    cors_origins: list[str] = field(default_factory=list)   # empty: CORS off
    shutdown_grace_s: float = 30.0      # SIGTERM to exit, drain and engine stops included
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: LogLevel = "info"
    on_engine_dead: OnEngineDead = "serve_others"   # or exit (non-zero, for an orchestrator to restart the server)

    def __post_init__(self) -> None:
        if not self.models:
            raise ServeConfigError("config needs at least one entry under 'models'")
        for name in self.models:
            if "+" in name:
                raise ServeConfigError(f"model name {name!r} must not contain '+' (it separates model and restraint)")
        check_choices(self, "config")
        if self.default_max_tokens is None:
            self.default_max_tokens = min(DEFAULT_MAX_TOKENS, int(self.max_new_tokens))
        for key in ("max_inline_units", "max_body_bytes", "max_queue", "max_batch", "max_new_tokens",
                    "default_max_tokens", "max_stop_strings", "max_stop_chars", "max_choices", "max_metadata_bytes",
                    "max_queue_per_key", "max_registered_restraints"):
            if int(getattr(self, key)) < 1:
                raise ServeConfigError(f"{key} must be >= 1")
        if self.default_max_tokens > self.max_new_tokens:
            raise ServeConfigError(f"default_max_tokens {self.default_max_tokens} is over max_new_tokens "
                                   f"{self.max_new_tokens}")
        if self.request_timeout_s <= 0:
            raise ServeConfigError("request_timeout_s must be > 0")
        if not self.shutdown_grace_s > 0:
            raise ServeConfigError("shutdown_grace_s must be > 0")
        if self.allowed_hosts is not None:
            self.allowed_hosts = check_hosts(self.allowed_hosts)

    @classmethod
    def from_dict(cls, data: dict[str, Any], base_dir: str | os.PathLike = ".",
                  engine: str | None = None) -> ServeConfig:
        """`engine`: serve every model with this engine, whatever its entry says."""
        if not isinstance(data, dict):
            raise ServeConfigError("the serve config must be a mapping")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ServeConfigError(f"unknown config field(s) {sorted(unknown)}")
        base = Path(base_dir)
        data = dict(data)
        for key, example in (("models", "models: {NAME: {path: DIR}}"), ("restraints", "restraints: {NAME: FILE}")):
            if not isinstance(data.get(key) or {}, dict):
                raise ServeConfigError(f"`{key}` must be a mapping of names, as `{example}`, not a "
                                       f"{type(data[key]).__name__}")
        models = {str(name): ModelConfig.parse(str(name), entry, base, engine)
                  for name, entry in (data.pop("models", None) or {}).items()}
        restraints = {str(k): str(_resolve(base, v)) for k, v in (data.pop("restraints", None) or {}).items()}
        for key in ("api_key_file", "db"):
            if data.get(key) and not (key == "db" and is_url(data[key])):
                data[key] = str(_resolve(base, data[key]))
        return cls(models=models, restraints=restraints, **data)

    @classmethod
    def load(cls, path: str | os.PathLike, engine: str | None = None) -> ServeConfig:
        path = Path(path)
        wanted = "expected a serve config (YAML with a `models` mapping)"
        try:
            expect(path, ("serve-config", "yaml", "json", "text", "binary", "non-utf8"), wanted)
        except InputError as exc:
            raise ServeConfigError(str(exc)) from None
        try:
            return cls.from_dict(read_yaml(path, ServeConfigError, "config file"), path.parent, engine)
        except ServeConfigError as exc:
            raise ServeConfigError(str(exc) if str(path) in str(exc) else f"{path}: {exc}") from None

    def preflight(self) -> None:
        """What can be checked before serving without loading anything: ServeConfigError naming the model and setting."""
        for name, model in self.models.items():
            model.preflight(name)
        from rolemrc.intervene.fit import check_origin
        from rolemrc.intervene.spec import Restraint, RestraintError

        for spec in self.restraints.values():
            restraint = Restraint.load(spec)
            for name, model in self.models.items():
                for directory in model.directories():
                    try:
                        check_origin(restraint, directory, self.strict_restraints, shape=False)   # a misfit: not served there
                    except RestraintError as exc:
                        raise ServeConfigError(f"model {name!r}: {exc} (strict_restraints: true)") from None

    def api_keys(self) -> dict[str, Role]:
        """Keys accepted in `Authorization: Bearer`, with their roles; empty (auth off) only where no source is
        configured. ServeConfigError for a configured source that yields no key, or a line it cannot read."""
        keys: dict[str, Role] = {}
        if self.api_key_env:
            value = os.environ.get(self.api_key_env)
            if not value:
                raise ServeConfigError(f"api_key_env {self.api_key_env!r} is set in the config but empty in the environment")
            entries = [item.strip().rsplit(":", 1) if ":" in item else [item.strip()] for item in value.split(",")]
            _add_keys(keys, [e for e in entries if e[0]], f"${self.api_key_env}")
        if self.api_key_file:
            try:
                lines = Path(self.api_key_file).read_text().splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                raise ServeConfigError(f"api_key_file {self.api_key_file}: unreadable ({exc})") from None
            entries = [line.split() for line in lines if line.strip() and not line.lstrip().startswith("#")]
            _add_keys(keys, entries, f"api_key_file {self.api_key_file}")
        return keys

    def check_auth(self, host: str) -> dict[str, Role]:
        """The keys to serve `host` with: without any, a loopback host is served (admin routes only with
        `allow_no_auth: true`, see `routes.admin`), any other host only with `allow_no_auth: true` (else
        ServeConfigError)."""
        keys = self.api_keys()
        if not (keys or is_loopback(host) or self.allow_no_auth):
            raise ServeConfigError(f"host {host} is reachable from other machines, but no API keys are configured: "
                                   "set api_key_file or api_key_env (or allow_no_auth: true to serve it open)")
        return keys

    def host_names(self, host: str) -> frozenset[str] | None:
        """The names a request's Host header may give when serving on `host`, besides loopback names (always
        served); None: any."""
        if self.allowed_hosts is None:
            return frozenset() if is_loopback(host) else None
        return None if "*" in self.allowed_hosts else frozenset(self.allowed_hosts)


def _add_keys(keys: dict[str, Role], entries: list[list[str]], source: str) -> None:
    """Add `[KEY]` or `[KEY, ROLE]` entries from `source`; ServeConfigError when it has none or a bad one."""
    if not entries:
        raise ServeConfigError(f"{source} holds no API key: an empty key set would serve everyone")
    for entry in entries:
        key, role = entry[0], entry[1] if len(entry) > 1 else "serve"
        if len(entry) > 2 or role not in ROLES:
            raise ServeConfigError(f"{source}: a key's role must be one of {ROLES}, not {' '.join(entry[1:])!r}")
        if keys.setdefault(key, role) != role:
            raise ServeConfigError(f"{source}: a key is listed with two roles ({keys[key]} and {role})")


def check_hosts(names: Any) -> list[str]:
    """`allowed_hosts` lower-cased: each a host name or IP address without a port (`*.example.org`: its subdomains,
    `*`: any name); ServeConfigError otherwise."""
    if not isinstance(names, list) or not names:
        raise ServeConfigError("allowed_hosts must be a non-empty list of host names (leave it out for the default)")
    checked = []
    for name in names:
        value = name.strip().lower().rstrip(".") if isinstance(name, str) else ""
        try:
            checked.append(str(ipaddress.ip_address(value.strip("[]"))))
            continue
        except ValueError:
            pass
        if not (value == "*" or _HOSTNAME.fullmatch(value.removeprefix("*."))):
            raise ServeConfigError(f"allowed_hosts: {name!r} is not a host name or IP address (no scheme, port or "
                                   "path: any port is served)")
        checked.append(value)
    return checked


def is_loopback(host: str) -> bool:
    """`localhost` or a loopback IP address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _resolve(base: Path, value: str) -> Path:
    path = Path(os.path.expanduser(str(value)))
    return path if path.is_absolute() else (base / path).resolve()


def _model_dir(where: str, base: Path, value: str) -> Path:
    """A model field's directory: a pulled model's name or a hub id resolved by `core.modeling.resolve_model` (a hub
    id is looked up now, before anything is served), else a path resolved against `base` (checked by `preflight`)."""
    name = str(value)
    if (looks_like_path(name) or (base / name).exists() or ("/" not in name
            and not (pulled_models() / name / "config.json").is_file())):
        return _resolve(base, value)
    from rolemrc.core.modeling import resolve_model

    try:
        return resolve_model(str(value))
    except InputError as exc:
        raise ServeConfigError(f"{where}: {exc}") from None


def check_model_dir(where: str, path: str) -> None:
    """ServeConfigError unless `path` is a Hugging Face model directory: a readable config.json, weights and a tokenizer
    (a GGUF file is named as one, with the command that converts it)."""
    folder = Path(path)
    ggufs = [folder] if folder.is_file() and folder.suffix == ".gguf" else sorted(folder.glob("*.gguf"))
    if not (folder / "config.json").is_file():
        what = ("no such directory" if not folder.exists() else "not a directory" if not folder.is_dir()
                else "not a Hugging Face model directory (no config.json)")
        if ggufs:
            what = f"a GGUF file, not a model directory: convert it first (`rolemrc models convert {ggufs[0]} --out DIR`)"
        raise ServeConfigError(f"{where} {path}: {what}")
    try:
        json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ServeConfigError(f"{where} {path}: config.json is unreadable ({exc})") from None
    if not any(any(folder.glob(pattern)) for pattern in ("*.safetensors", "*.bin", "*.pt")):
        raise ServeConfigError(f"{where} {path}: no weights (*.safetensors or *.bin)")
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ServeConfigError(f"{where} {path}: no tokenizer (tokenizer.json or tokenizer_config.json)")


def check_choices(obj: T, where: str) -> T:
    """`obj` (a dataclass) if each of its `Literal` fields holds one of the choices, else ServeConfigError."""
    for name, hint in get_type_hints(type(obj)).items():
        if get_origin(hint) is Literal and getattr(obj, name) not in get_args(hint):
            raise ServeConfigError(f"{where}: {name} {getattr(obj, name)!r} is not one of {get_args(hint)}")
    return obj
