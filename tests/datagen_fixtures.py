"""Shared helpers for the datagen tests: a small MRC pool (fast embedding) and file comparison."""

from __future__ import annotations

from pathlib import Path

from rolemrc.core.io import write_jsonl
from rolemrc.datagen.sources import load_triplets

OUTPUT_FILES = ("profiles.jsonl", "sft.jsonl", "pairs.jsonl", "test.jsonl", "stats.json", "stats.md")


def small_pool(path: Path, n: int = 64) -> Path:
    """Every 5th bundled triplet (keeps answerable and unanswerable ones across all domains)."""
    triplets = load_triplets()[::5][:n]
    write_jsonl(path, triplets)
    return path


def read_outputs(out: Path) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in OUTPUT_FILES}
