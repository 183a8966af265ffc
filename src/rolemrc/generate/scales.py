"""Restraints per slot: each site's tables [slots, width], one per operation a joined restraint needs (scale, shift,
direction: `intervene.runtime.OPS`), a request's rows written when it joins and reset when it leaves (scale to ones,
shift and direction to zeros: each then changes nothing). A site's hook is installed while some slot restrains it, so
unrestrained batches run without hooks, and every forward rewrites whole rows at once (nothing per unit, nothing per
step in Python)."""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

import torch

from rolemrc.core.hooks import site, width
from rolemrc.intervene.runtime import OPS, SiteRows, rewrite, site_rows
from rolemrc.intervene.spec import Restraint

Site = tuple[str, int]   # (hook point, layer)
KNOWN = 256   # restraints whose rows are kept ready
RESET = {"scale": 1.0, "shift": 0.0, "direction": 0.0}   # a table row that changes nothing


class SlotScales:
    """The restraint rows of every slot. `rows` (set before each forward) says which slots the batch rows are: a
    contiguous run (the decode step) or an index (a prefill group)."""

    def __init__(self, model: Any, slots: int) -> None:
        self.model, self.slots = model, slots
        self.tables: dict[Site, dict[str, torch.Tensor]] = {}
        self.users: Counter[Site] = Counter()
        self.handles: dict[Site, Any] = {}
        self.hooked_ops: dict[Site, tuple[str, ...]] = {}
        self.held: dict[int, Restraint] = {}
        self.rows: slice | torch.Tensor = slice(0, 0)
        self._known: OrderedDict[int, tuple[Restraint, str, dict[Site, SiteRows]]] = OrderedDict()

    @property
    def sites(self) -> tuple[tuple[str, int, tuple[str, ...]], ...]:
        """The sites hooked now, with the operations each hook runs (they shape the forward: part of a captured
        graph's key)."""
        return tuple(sorted((*key, self.hooked_ops[key]) for key in self.handles))

    def known(self, restraint: Restraint) -> tuple[str, dict[Site, SiteRows]]:
        """The restraint's digest and its rows per site, made once per restraint object (the last `KNOWN` kept), so a
        request joining costs one row copy per site and operation."""
        entry = self._known.get(id(restraint))
        if entry is None or entry[0] is not restraint:
            param = next(self.model.parameters())
            n_units = width(self.model, restraint.hook)
            rows = {(restraint.hook, layer): site_rows(restraint, layer, n_units, param.dtype, param.device)
                    for layer in restraint.sites}
            entry = (restraint, restraint.digest, rows)
            self._known[id(restraint)] = entry
            if len(self._known) > KNOWN:
                self._known.popitem(last=False)
        self._known.move_to_end(id(restraint))
        return entry[1], entry[2]

    def assign(self, slot: int, restraint: Restraint | None) -> None:
        """Give `slot` this restraint (validated against the model already); None leaves its rows unchanged."""
        if restraint is None:
            return
        for key, rows in self.known(restraint)[1].items():
            tables = self.tables.setdefault(key, {})
            for op in OPS:
                row = getattr(rows, op)
                if row is None:
                    continue
                if op not in tables:
                    tables[op] = torch.full((self.slots, row.shape[0]), RESET[op], dtype=row.dtype, device=row.device)
                tables[op][slot] = row
            self.users[key] += 1
            ops = tuple(op for op in OPS if op in tables)
            if self.hooked_ops.get(key) != ops:   # a first hook, or one that now needs another table
                if key in self.handles:
                    self.handles.pop(key).remove()
                self.handles[key] = site(self.model, *key).rewrite(self._hook(tables, ops))
                self.hooked_ops[key] = ops
        self.held[slot] = restraint

    def _hook(self, tables: dict[str, torch.Tensor], ops: tuple[str, ...]) -> Any:
        """The rewrite of one site: each batch row by its slot's rows of `ops`."""
        def hook(t: torch.Tensor) -> torch.Tensor:
            rows = {op: tables[op][self.rows][:, None, :] for op in ops}
            return rewrite(t, rows.get("scale"), rows.get("shift"), rows.get("direction"))
        return hook

    def release(self, slot: int) -> None:
        """`slot` is free: its rows back to changing nothing, hooks no slot needs any more removed."""
        restraint = self.held.pop(slot, None)
        if restraint is None:
            return
        for layer in restraint.sites:
            key = (restraint.hook, layer)
            for op, table in self.tables[key].items():
                table[slot] = RESET[op]
            self.users[key] -= 1
            if not self.users[key]:
                self.handles.pop(key).remove()
                del self.users[key], self.hooked_ops[key]
