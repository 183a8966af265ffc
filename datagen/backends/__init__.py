"""LLM backends: `template` (offline, deterministic) and `openai` (any OpenAI-compatible endpoint)."""

from __future__ import annotations

from rolemrc.core.errors import RolemrcError
from rolemrc.datagen.config import BackendConfig, DatagenError


class BackendError(RolemrcError, RuntimeError):
    """The backend cannot serve requests (not a malformed reply): the run stops and can be resumed."""


class DroppedError(RolemrcError, ValueError):
    """An item could not be produced after all attempts; the message is the counted reason."""


def make_backend(config: BackendConfig, *, seed: int, cache_path=None):
    """The backend named in `config`."""
    if config.name == "template":
        from rolemrc.datagen.backends.template import TemplateBackend

        return TemplateBackend(seed=seed)
    if config.name == "openai":
        from rolemrc.datagen.backends.openai_api import OpenAIBackend

        return OpenAIBackend(config, cache_path=cache_path)
    raise DatagenError(f"unknown backend {config.name!r}; choose 'template' or 'openai'")
