"""Append-only JSONL journal of finished work units, safe against SIGKILL.

Each finished unit is one line, flushed and fsynced before the next starts. On reopen, a torn
last line (the process died mid-write) is cut off, so that unit is simply done again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rolemrc.core.io import JsonlError


class Journal:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.done: dict[str, dict[str, Any]] = self._recover()
        self._fh = self.path.open("a", encoding="utf-8")

    def _recover(self) -> dict[str, dict[str, Any]]:
        if not self.path.exists():
            return {}
        data = self.path.read_bytes()
        done, good = {}, 0
        for lineno, line in enumerate(data.splitlines(keepends=True), start=1):
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("torn line")
                record = json.loads(line)
            except ValueError:
                if good + len(line) < len(data):  # damage before the end is not a torn write
                    raise JsonlError(f"{self.path}:{lineno}: corrupt journal line; delete the file to redo this stage") from None
                break
            done[record["key"]] = record
            good += len(line)
        if good < len(data):
            with self.path.open("r+b") as fh:
                fh.truncate(good)
        return done

    def append(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.done[record["key"]] = record

    def close(self) -> None:
        self._fh.close()
