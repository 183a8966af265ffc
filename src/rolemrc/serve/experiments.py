"""A/B arm assignment: sticky by a hash of (experiment, user), proportional to the arms' weights."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any


def unit_hash(experiment: str, user: str) -> float:
    """A stable number in [0, 1) for this user in this experiment."""
    digest = hashlib.sha256(f"{experiment}\x00{user}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign(experiment: str, arms: list[dict[str, Any]], user: str | None) -> dict[str, Any]:
    """The arm serving `user` (the same one every time); without a user, a random arm by weight."""
    point = unit_hash(experiment, user if user is not None else uuid.uuid4().hex)
    total = sum(float(a["weight"]) for a in arms)
    edge = 0.0
    for arm in arms:
        edge += float(arm["weight"]) / total
        if point < edge:
            return arm
    return arms[-1]
