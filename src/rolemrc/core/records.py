"""RoleMRC record shapes (docs/ARCHITECTURE.md "Records"): field aliases, turn normalisation and canonical records.

Every reader of test, SFT and pair files goes through `normalize_record` (or `read_records`), so the
aliases other dumps use are accepted in one place: turns may come from `question`, `prompt`,
`conversations` or `messages` (a plain-string prompt is one user turn), the gold reply from `reference`,
`chosen`, `answer` or `target`, and a record without `id` gets `line-<n>` from its line number.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from rolemrc.core.artifacts import JSONL_INPUT, expect
from rolemrc.core.errors import InputError
from rolemrc.core.io import iter_jsonl

ROLES = ("system", "user", "assistant")
Kind = Literal["test", "pair", "sft"]

TURN_FIELDS: tuple[str, ...] = ("question", "prompt", "conversations", "messages")
REFERENCE_FIELDS: tuple[str, ...] = ("reference", "chosen", "answer", "target")
CANONICAL_TURNS: dict[str, str] = {"test": "question", "pair": "prompt", "sft": "conversations"}
CANONICAL_REFERENCE: dict[str, str | None] = {"test": "reference", "pair": "chosen", "sft": None}
LINE_ID = "line number"
ABSENT = "absent"


class RecordError(InputError):
    """A record does not have the shape its kind requires; `reason` is a short category for counting."""

    def __init__(self, message: str, reason: str = "malformed record") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Fields:
    """Where a canonical record's turns, reference and id came from (`LINE_ID` for a derived id)."""

    turns: str
    reference: str | None
    id: str

    def as_dict(self) -> dict[str, str | None]:
        return asdict(self)


def normalize_turns(turns: Any, *, where: str = "record") -> list[dict[str, str]]:
    """Lower-case roles (the release uses `System`/`User`/`Assistant`) and check each turn."""
    if not isinstance(turns, list) or not turns:
        raise RecordError(f"{where}: expected a non-empty list of turns", "malformed turns")
    out = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise RecordError(f"{where}: turn {k} needs 'role' and 'content'", "malformed turns")
        role = str(turn["role"]).lower()
        if role not in ROLES:
            raise RecordError(f"{where}: turn {k} has unknown role {turn['role']!r} (expected one of {ROLES})",
                              "malformed turns")
        if not isinstance(turn["content"], str):
            raise RecordError(f"{where}: turn {k} content must be a string", "malformed turns")
        out.append({"role": role, "content": turn["content"]})
    return out


def as_turns(value: Any, *, where: str = "record") -> list[dict[str, str]]:
    """Turns from a list of turns, or one user turn from a plain-string prompt."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return normalize_turns(value, where=where)


def as_records(items: list[Any]) -> list[dict[str, Any]]:
    """In-memory prompts as records: a dict is a record already; a plain string is one user turn and a list of turns
    a conversation, each given the id `prompt-<index>` (no task, so a probe counts them under `all`)."""
    return [item if isinstance(item, dict) else {"id": f"prompt-{i}", "question": as_turns(item, where=f"prompt {i}")}
            for i, item in enumerate(items)]


def first_cases(records: list[Any], limit: int | None) -> list[Any]:
    """The first `limit` records (all of them for None): `--limit N`, a quick run on the start of the data (lm-eval's
    meaning). A limit under 1 is an InputError."""
    if limit is None:
        return records
    if limit < 1:
        raise InputError(f"limit must be at least 1 case, got {limit}")
    return records[:limit]


def reply_text(value: Any, name: str, *, where: str = "record") -> str | None:
    """A gold reply as text: a string (kept), turns ending in an assistant turn (its content), or None."""
    if value is None or isinstance(value, str):
        return value
    turns = normalize_turns(value, where=f"{where}: {name}")
    if turns[-1]["role"] != "assistant":
        raise RecordError(f"{where}: {name} does not end with an assistant turn", f"{name} does not end with an assistant turn")
    return turns[-1]["content"]


def _first(record: dict[str, Any], canonical: str | None, names: tuple[str, ...]) -> str | None:
    """The first field of `names` present in the record, the canonical name tried first."""
    order = ([canonical] if canonical else []) + [n for n in names if n != canonical]
    return next((n for n in order if n in record), None)


def normalize_record(record: dict[str, Any], lineno: int | None = None, kind: Kind = "test", *,
                     where: str | None = None) -> tuple[dict[str, Any], Fields]:
    """(canonical record, the fields used). Canonical names: test `question`/`reference`, pair
    `prompt`/`chosen`, SFT `conversations` (the reply appended when the turns lack it); `id` always set
    (`line-<lineno>` when missing). A prompt ending with an assistant turn and no reference field gives
    that turn as the reference. Other fields are kept; a `fields` mapping already present is kept."""
    where = where or (f"line {lineno}" if lineno else "record")
    turns_field = _first(record, CANONICAL_TURNS[kind], TURN_FIELDS)
    if turns_field is None:
        names = ", ".join(f"'{n}'" for n in TURN_FIELDS[:-1]) + f" or '{TURN_FIELDS[-1]}'"
        raise RecordError(f"{where}: no {names} field", f"no {CANONICAL_TURNS[kind]} field")
    turns = as_turns(record[turns_field], where=where)
    reference_field = _first(record, CANONICAL_REFERENCE[kind], REFERENCE_FIELDS)
    reference = reply_text(record[reference_field], reference_field, where=where) if reference_field else None
    if kind == "sft":
        if reference_field and turns[-1]["role"] != "assistant" and reference is not None:
            turns.append({"role": "assistant", "content": reference})
        else:
            reference_field = None
    elif reference_field is None and turns[-1]["role"] == "assistant":
        reference, reference_field = turns.pop()["content"], f"last assistant turn of {turns_field}"
        if not turns:
            raise RecordError(f"{where}: {turns_field} has no turn before its last assistant turn", "no prompt turns")
    if "id" in record:
        rid, id_field = record["id"], "id"
    else:
        rid, id_field = (f"line-{lineno}" if lineno else None), LINE_ID
    fields = Fields(turns_field, reference_field, id_field)
    consumed = {turns_field, reference_field} - {None}
    out = {k: v for k, v in record.items() if k not in consumed}
    out |= {"id": rid, CANONICAL_TURNS[kind]: turns, "fields": record.get("fields") or fields.as_dict()}
    if CANONICAL_REFERENCE[kind]:
        out[CANONICAL_REFERENCE[kind]] = reference
    return out, fields


def prompt_turns(record: dict[str, Any], *, where: str = "record") -> list[dict[str, str]]:
    """The turns a model is prompted with, for any record kind and alias (`question`, `prompt`,
    `conversations`, `messages`): a conversation without its closing assistant reply."""
    return normalize_record(record, kind="test", where=where)[0]["question"]


def merge_fields(fields: Iterable[Fields | dict[str, Any]]) -> dict[str, str]:
    """One mapping for many records: each canonical field -> the source names used, joined by '|'."""
    seen: dict[str, dict[str, None]] = {}
    for f in fields:
        for key, name in (f.as_dict() if isinstance(f, Fields) else f).items():
            seen.setdefault(key, {})[ABSENT if name is None else str(name)] = None
    return {key: "|".join(names) for key, names in seen.items()}


def fields_note(source: str | os.PathLike, kind: Kind, merged: dict[str, str]) -> str | None:
    """A one-line note when a file's records used aliases or derived ids, else None."""
    canonical = {"turns": CANONICAL_TURNS[kind], "reference": CANONICAL_REFERENCE[kind] or ABSENT, "id": "id"}
    if all(merged.get(key, value) == value for key, value in canonical.items()):
        return None
    return f"note: {source}: fields used: " + ", ".join(f"{key}={name}" for key, name in merged.items())


def announce_fields(source: str | os.PathLike, kind: Kind, merged: dict[str, str]) -> None:
    """Print `fields_note` on stderr when there is one."""
    note = fields_note(source, kind, merged)
    if note:
        print(note, file=sys.stderr)


def read_records(path: str | os.PathLike, kind: Kind = "test") -> tuple[list[dict[str, Any]], dict[str, str]]:
    """(canonical records, the fields used) of a JSONL file; a bad record is a RecordError naming file and
    line. Notes aliases and derived ids on stderr."""
    wanted = f"expected a JSONL file of {'preference pairs' if kind == 'pair' else 'records'}"
    records, used = [], []
    expect(path, JSONL_INPUT, wanted)
    for lineno, raw in iter_jsonl(path):
        record, fields = normalize_record(raw, lineno, kind, where=f"{path}:{lineno}")
        records.append(record)
        used.append(fields)
    if not records:
        raise RecordError(f"{path} holds no records (only blank lines); {wanted}", "no records")
    merged = merge_fields(used)
    announce_fields(Path(path), kind, merged)
    return records, merged
