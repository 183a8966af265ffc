"""Restraints per slot: each site's multipliers [slots, width], a request's row written when it joins and reset to
ones when it leaves. A site's hook is installed while some slot restrains it, so unrestrained batches run without
hooks, and every forward multiplies whole rows at once (nothing per unit, nothing per step in Python)."""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

import torch

from rolemrc.core.hooks import site, width
from rolemrc.intervene.runtime import scale_vector
from rolemrc.intervene.spec import Restraint

Site = tuple[str, int]   # (hook point, layer)
KNOWN = 256   # restraints whose rows are kept ready


class SlotScales:
    """The restraint multipliers of every slot. `rows` (set before each forward) says which slots the batch rows
    are: a contiguous run (the decode step) or an index (a prefill group)."""

    def __init__(self, model: Any, slots: int) -> None:
        self.model, self.slots = model, slots
        self.tables: dict[Site, torch.Tensor] = {}
        self.users: Counter[Site] = Counter()
        self.handles: dict[Site, Any] = {}
        self.held: dict[int, Restraint] = {}
        self.rows: slice | torch.Tensor = slice(0, 0)
        self._known: OrderedDict[int, tuple[Restraint, str, dict[Site, torch.Tensor]]] = OrderedDict()

    @property
    def sites(self) -> tuple[Site, ...]:
        """The sites hooked now (they shape the forward: part of a captured graph's key)."""
        return tuple(sorted(self.handles))

    def known(self, restraint: Restraint) -> tuple[str, dict[Site, torch.Tensor]]:
        """The restraint's digest and its multipliers [width] per site, made once per restraint object (the last
        `KNOWN` kept), so a request joining costs one row copy per site."""
        entry = self._known.get(id(restraint))
        if entry is None or entry[0] is not restraint:
            param = next(self.model.parameters())
            n_units = width(self.model, restraint.hook)
            rows = {(restraint.hook, layer): scale_vector(restraint, layer, n_units, param.dtype, param.device)
                    for layer in restraint.units}
            entry = (restraint, restraint.digest, rows)
            self._known[id(restraint)] = entry
            if len(self._known) > KNOWN:
                self._known.popitem(last=False)
        self._known.move_to_end(id(restraint))
        return entry[1], entry[2]

    def assign(self, slot: int, restraint: Restraint | None) -> None:
        """Give `slot` this restraint (validated against the model already); None leaves it all ones."""
        if restraint is None:
            return
        for key, row in self.known(restraint)[1].items():
            if key not in self.tables:
                self.tables[key] = torch.ones(self.slots, row.shape[0], dtype=row.dtype, device=row.device)
            self.tables[key][slot] = row
            self.users[key] += 1
            if key not in self.handles:
                table = self.tables[key]
                self.handles[key] = site(self.model, *key).rewrite(
                    lambda t, table=table: t * table[self.rows].to(t.dtype)[:, None, :])
        self.held[slot] = restraint

    def release(self, slot: int) -> None:
        """`slot` is free: its rows back to ones, hooks no slot needs any more removed."""
        restraint = self.held.pop(slot, None)
        if restraint is None:
            return
        for layer in restraint.units:
            key = (restraint.hook, layer)
            self.tables[key][slot] = 1
            self.users[key] -= 1
            if not self.users[key]:
                self.handles.pop(key).remove()
                del self.users[key]
