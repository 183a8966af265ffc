"""Shared foundations: taxonomy, record io, chat formatting, model loading, tiny models."""

from rolemrc.core.io import JsonlError, file_fingerprint, read_jsonl, write_jsonl
from rolemrc.core.taxonomy import DIMENSIONS, TASK_COUNTS, dimensions_for_task, judge_aspects_for_task

__all__ = [
    "DIMENSIONS",
    "TASK_COUNTS",
    "JsonlError",
    "dimensions_for_task",
    "file_fingerprint",
    "judge_aspects_for_task",
    "read_jsonl",
    "write_jsonl",
]
