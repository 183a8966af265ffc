"""One line on stderr per long step, with its duration."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console

_console = Console(stderr=True, highlight=False, soft_wrap=True)


def note(message: str) -> None:
    _console.print(message)


@contextmanager
def step(message: str) -> Iterator[None]:
    """Print `message...` before the step and its duration after it."""
    _console.print(f"{message}...")
    start = time.perf_counter()
    yield
    _console.print(f"  done in {time.perf_counter() - start:.1f}s")
