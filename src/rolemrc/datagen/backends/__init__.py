"""LLM backends: `template` (offline, deterministic) and `openai` (any OpenAI-compatible endpoint)."""

from __future__ import annotations

from rolemrc.datagen.config import BackendConfig, DatagenError


def make_backend(config: BackendConfig, *, seed: int, cache_path=None):
    """The backend named in `config`."""
    if config.name == "template":
        from rolemrc.datagen.backends.template import TemplateBackend

        return TemplateBackend(seed=seed)
    if config.name == "openai":
        from rolemrc.datagen.backends.openai_api import OpenAIBackend

        return OpenAIBackend(config, cache_path=cache_path)
    raise DatagenError(f"unknown backend {config.name!r}; choose 'template' or 'openai'")
