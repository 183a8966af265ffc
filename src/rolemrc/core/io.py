"""JSONL, YAML and fingerprint helpers with errors that name the file (and line)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from rolemrc.core.artifacts import JSONL_INPUT, KINDS, describe, expect, identify
from rolemrc.core.errors import InputError


def cache_dir() -> Path:
    """rolemrc's cache: $ROLEMRC_CACHE, else $XDG_CACHE_HOME/rolemrc, else ~/.cache/rolemrc."""
    root = os.environ.get("ROLEMRC_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rolemrc"
    return Path(root)


def pulled_models() -> Path:
    """Where `rolemrc models pull NAME` puts models, and model names are looked up: the cache's models/ (read now)."""
    return cache_dir() / "models"


class JsonlError(InputError):
    """A JSONL file could not be read; the message names the file and line."""


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, record) for each non-blank line; raise JsonlError on bad lines."""
    path = Path(path)
    if not path.is_file():
        raise JsonlError(f"{path}: no such file" if not path.exists() else f"{path} is {describe(path)}; expected a "
                         "JSONL file of records")
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise JsonlError(not_records(path) or f"{path}:{lineno}: not UTF-8 text (byte {raw[exc.start]:#04x} at "
                                 f"column {exc.start + 1}); is this a JSONL file?") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise JsonlError(not_records(path) or f"{path}:{lineno}: invalid JSON ({exc.msg} at column "
                                 f"{exc.colno})") from None
            if not isinstance(record, dict):
                raise JsonlError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            yield lineno, record


def not_records(path: Path, what: str = "JSONL file of records") -> str | None:
    """For a file that does not parse as `what`: what it is instead, when it is something rolemrc knows (a probe file,
    a GGUF, ...), else None (the parser's own message says more)."""
    kind = identify(path)
    if kind in ("binary", "non-utf8", "text", "records", "responses", "json", "yaml"):
        return None
    return f"{path} is {KINDS[kind]}; expected a {what}"


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read a whole JSONL file of objects."""
    return [record for _, record in iter_jsonl(path)]


def read_input_jsonl(path: str | os.PathLike, wanted: str = "expected a JSONL file of records",
                     kinds: tuple[str, ...] = JSONL_INPUT) -> list[dict[str, Any]]:
    """A JSONL file the user named: one of another kind, or one with no records, is an InputError saying what it
    is and then `wanted`."""
    expect(path, kinds, wanted)
    records = read_jsonl(path)
    if not records:
        raise JsonlError(f"{path} holds no records (only blank lines); {wanted}")
    return records


def read_yaml(path: str | os.PathLike, error: type[Exception] = InputError, what: str = "YAML file") -> Any:
    """A YAML (or JSON) file's content; a missing or unparsable file raises `error` naming the path."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: no such {what}" if not path.exists() else f"{path} is {describe(path)}; expected a {what}")
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise error(not_records(path, what) or f"{path}: not UTF-8 text; is this a {what}?") from None
    except yaml.YAMLError as exc:
        raise error(not_records(path, what) or f"{path}: not valid YAML ({exc})") from None


def write_text(path: str | os.PathLike, text: str) -> None:
    """Atomic text write (temp file + rename): a killed process never leaves half a file."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Atomic JSON write (indented, UTF-8)."""
    write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def write_jsonl(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> int:
    """Write records atomically (temp file + rename); return how many were written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    n = 0
    with tmp.open("w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
            n += 1
    os.replace(tmp, path)
    return n


def file_fingerprint(path: str | os.PathLike, sample_over: int = 2 << 30) -> str:
    """sha256 of a file (or of a directory's files, sorted by name), 16 hex digits.

    Files larger than `sample_over` bytes are fingerprinted from their size and 64 evenly spaced
    1 MiB chunks, so multi-GB checkpoints fingerprint in seconds.
    """
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        size = file.stat().st_size
        digest.update(size.to_bytes(8, "little"))
        with file.open("rb") as fh:
            if size <= sample_over:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
            else:
                for k in range(64):
                    fh.seek(k * (size - (1 << 20)) // 63)
                    digest.update(fh.read(1 << 20))
    return digest.hexdigest()[:16]
