"""Prompt prefixes already in the cache. A prompt is cut into blocks of `BLOCK` tokens, each named by a hash chained
over the blocks before it and the request's restraint (a restraint changes the keys and values), so one hash names a
whole prefix. A slot holds its prompt's blocks while it runs and after it is freed, until a new request overwrites
it; a request whose prompt begins like one held shares those pages with that slot instead of computing them
again (role-play prompts share their persona's system prompt; a sweep runs the same prompts under many restraints)."""

from __future__ import annotations

BLOCK = 16


def block_hashes(key: str, prompt: list[int], usable: int) -> list[int]:
    """Chained hashes of the full blocks among the first `usable` tokens of `prompt`, under restraint `key`."""
    out, h = [], hash(key)
    for start in range(0, usable - usable % BLOCK, BLOCK):
        h = hash((h, tuple(prompt[start:start + BLOCK])))
        out.append(h)
    return out


class PrefixIndex:
    """Which slots hold which prefixes (by their last block's hash)."""

    def __init__(self) -> None:
        self.slots: dict[int, set[int]] = {}
        self.held: dict[int, list[int]] = {}

    def longest(self, hashes: list[int]) -> tuple[int, int | None]:
        """The most leading blocks of `hashes` some slot holds, and one such slot (None if no block is held)."""
        for blocks in range(len(hashes), 0, -1):
            holders = self.slots.get(hashes[blocks - 1])
            if holders:
                return blocks, min(holders)
        return 0, None

    def hold(self, slot: int, hashes: list[int]) -> None:
        """`slot` now holds exactly the prefix `hashes` names."""
        self.drop(slot)
        self.held[slot] = hashes
        for h in hashes:
            self.slots.setdefault(h, set()).add(slot)

    def drop(self, slot: int) -> None:
        for h in self.held.pop(slot, []):
            holders = self.slots[h]
            holders.discard(slot)
            if not holders:
                del self.slots[h]

    def clear(self) -> None:
        """Forget every held prefix (the keys stay in the cache, unused): a benchmark's rounds start equal."""
        self.slots.clear()
        self.held.clear()
