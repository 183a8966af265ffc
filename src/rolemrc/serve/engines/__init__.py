"""The one registry of serving engines: the name a config's `engine:` key uses -> the engine class.

Adding an engine: a module here with a class meeting `base.Engine` (its `Options` dataclass beside it) and one
line below. Classes are named by import path and imported on first use (as vLLM's model registry does), so
config validation imports only the engines a config names and the CLI's help imports none (no torch)."""

from __future__ import annotations

import enum
import importlib

from rolemrc.serve.engines.base import Engine

ENGINES: dict[str, str] = {
    "transformers": "rolemrc.serve.engines.transformers:TransformersEngine",
    "vllm": "rolemrc.serve.engines.vllm:VllmEngine",
    "upstream": "rolemrc.serve.engines.upstream:UpstreamEngine",
}

# the engine names as a CLI choice: typer lists them in the help and refuses any other (exit 2)
EngineName = enum.Enum("EngineName", {name: name for name in ENGINES}, type=str)


def engine_class(name: str) -> type[Engine]:
    """The class registered as `name` (a KeyError for unknown names: callers validate against ENGINES)."""
    module, _, cls = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)
