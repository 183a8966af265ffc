"""Cached pipeline stages: a stage reruns only when its inputs' fingerprints change."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from rolemrc.core.errors import InputError
from rolemrc.core.io import file_fingerprint


def fingerprint(value: Any) -> Any:
    """JSON-able fingerprint of a stage input: paths by content, everything else as is."""
    from rolemrc.core.modeling import dir_fingerprint  # imports torch; the demo's CLI help must not

    if isinstance(value, Path):
        if not value.exists():
            raise InputError(f"stage input {value} does not exist")
        return dir_fingerprint(value) if (value / "config.json").is_file() else file_fingerprint(value)
    if isinstance(value, dict):
        return {k: fingerprint(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [fingerprint(v) for v in value]
    return value


class StageCache:
    """Runs named stages under `root`, remembering each one's input key and result in stages.json."""

    def __init__(self, root: str | os.PathLike, *, force: bool = False, console: Console | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.file = self.root / "stages.json"
        self.state: dict[str, dict] = json.loads(self.file.read_text()) if self.file.is_file() else {}
        self.force = force
        self.console = console or Console()
        self.timings: dict[str, float] = {}   # seconds per stage this run (0.0 when reused)
        self.ran: list[str] = []               # stages that ran this time (the rest were reused)

    def run(self, name: str, inputs: dict[str, Any], fn: Callable[[], dict], outputs: list[Path]) -> dict:
        """Return fn()'s result, or the remembered one if inputs and outputs are unchanged."""
        key = hashlib.sha256(json.dumps(fingerprint(inputs), sort_keys=True, default=str).encode()).hexdigest()[:16]
        cached = self.state.get(name)
        if not self.force and cached and cached["key"] == key and all(p.exists() for p in outputs):
            self.console.print(f"[dim]· {name}: unchanged inputs, reusing {', '.join(str(p) for p in outputs)}[/dim]")
            self.timings[name] = 0.0
            return cached["result"]
        self.console.rule(f"[bold]{name}")
        start = time.perf_counter()
        result = fn()
        self.timings[name] = round(time.perf_counter() - start, 1)
        self.ran.append(name)
        self.state[name] = {"key": key, "result": result, "seconds": self.timings[name]}
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1, default=str))
        os.replace(tmp, self.file)
        self.console.print(f"[green]✓ {name}[/green] in {self.timings[name]} s")
        return result
