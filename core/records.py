"""RoleMRC record shapes (docs/ARCHITECTURE.md "Records"): turn normalisation and field access."""

from __future__ import annotations

from typing import Any

from rolemrc.core.errors import InputError

ROLES = ("system", "user", "assistant")


class RecordError(InputError):
    """A record does not have the shape its kind requires."""


def normalize_turns(turns: Any, *, where: str = "record") -> list[dict[str, str]]:
    """Lower-case roles (the release uses `System`/`User`/`Assistant`) and check each turn."""
    if not isinstance(turns, list) or not turns:
        raise RecordError(f"{where}: expected a non-empty list of turns")
    out = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise RecordError(f"{where}: turn {k} needs 'role' and 'content'")
        role = str(turn["role"]).lower()
        if role not in ROLES:
            raise RecordError(f"{where}: turn {k} has unknown role {turn['role']!r} (expected one of {ROLES})")
        if not isinstance(turn["content"], str):
            raise RecordError(f"{where}: turn {k} content must be a string")
        out.append({"role": role, "content": turn["content"]})
    return out


def prompt_turns(record: dict[str, Any], *, where: str = "record") -> list[dict[str, str]]:
    """The turns a model is prompted with: `question` (test), `prompt` (pair), or the
    conversation up to (not including) its last assistant turn (SFT)."""
    for field in ("question", "prompt"):
        if field in record:
            return normalize_turns(record[field], where=where)
    if "conversations" in record:
        turns = normalize_turns(record["conversations"], where=where)
        while turns and turns[-1]["role"] == "assistant":
            turns.pop()
        if not turns:
            raise RecordError(f"{where}: conversation has no turn before its last assistant turn")
        return turns
    raise RecordError(f"{where}: no 'question', 'prompt' or 'conversations' field")
