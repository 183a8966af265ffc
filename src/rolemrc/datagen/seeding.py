"""Order-independent seeding: every item draws from its own RNG derived from stable keys."""

from __future__ import annotations

import hashlib
import random


def rng_for(*parts: object) -> random.Random:
    """A Random seeded from the parts (same parts -> same stream, whatever ran before)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))
