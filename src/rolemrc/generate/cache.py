"""The engine's KV cache: pages of `PAGE` positions, each request holding the pages its own prompt and completion
need (never `max_batch` x the longest), in a pool that grows by doubling up to a budget.

Every attention layer of a transformers model hands its new keys and values to `cache.update` and attends over what
it returns, so any such architecture decodes through this cache unchanged. Before each forward the engine says which
slots the batch rows are (`rows`), where each row's tokens go (`write`, [rows, tokens]) and how many positions to
attend over (`width`); the mask (`attention_mask`) says which of those a token sees. A slot's page table maps its
positions to pages; `update` writes through it and gathers the attended positions back ([rows, heads, width, dim]).
Unassigned positions map to page 0, which no request owns (a free slot's padding writes land there, masked from
everyone). A prompt prefix held by another slot is shared page by page (reference counted), not copied. The table and
the pools keep their addresses between growths, so a captured decode step (CUDA graphs) replays as is.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from rolemrc.generate.prefix import BLOCK

GRAIN = 128   # attended widths are multiples of this (few distinct shapes: CUDA graphs)
PAGE = BLOCK  # positions per page: a held prefix (whole blocks) is whole pages
NULL = 0      # the page unassigned positions map to


def round_up(n: int, grain: int = GRAIN) -> int:
    return -(-n // grain) * grain


def pages_for(positions: int) -> int:
    return -(-positions // PAGE)


class PagedCache(Cache):
    """Keys and values [kv_heads, pages, PAGE, head_dim] per layer, allocated on a layer's first write (so each
    layer's heads and dims are its own); `table` [slots, columns] maps each slot's positions to pages. Heads first:
    what `update` gathers is one contiguous [width, head_dim] matrix per row and head, as attention reads it.
    `capacity`: positions the pool may hold over all slots (None: unbounded); `max_length`: positions one slot may
    hold (None: unbounded)."""

    is_compileable = False

    def __init__(self, slots: int, capacity: int | None = None, max_length: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(layers=[])
        self.slots = slots
        self.max_pages = None if capacity is None else pages_for(capacity) + 1
        self.max_length = max_length
        self.pages = 2   # in each pool (page 0 included)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.owned: list[list[int]] = [[] for _ in range(slots)]   # each slot's pages, in position order
        self.refs = [0] * self.pages
        self.spare = [1]   # pages no slot holds
        self.table = torch.zeros(slots, self._columns(GRAIN), dtype=torch.long, device=device)
        self.rows: slice | torch.Tensor = slice(0, 0)    # the batch rows' slots: a contiguous run or an index
        self.dest = torch.empty(0, 0, dtype=torch.long)   # [rows, tokens] flat pool positions the new keys go to
        self.read = torch.empty(0, 0, dtype=torch.long)   # [rows, width // PAGE] pages attended over
        self._rows: dict[int, torch.Tensor] = {}   # heads -> what `update` gathers for this forward
        self.width = 0

    @staticmethod
    def _columns(length: int) -> int:
        """Table columns for slots of `length` positions: the attended widths' pages and one that stays NULL (the
        parking column: where a free slot's padding is written)."""
        return round_up(length) // PAGE + 1

    @property
    def parking(self) -> int:
        """A position every slot maps to page NULL."""
        return (self.table.shape[1] - 1) * PAGE

    def free_pages(self) -> int:
        """Pages an assignment can still take: spare ones and those the pool may grow by."""
        room = 0 if self.max_pages is None else self.max_pages - self.pages
        return len(self.spare) + (room if self.max_pages is not None else 1 << 62)

    def _plan(self, slot: int, length: int, source: int | None, shared: int) -> tuple[list[int], int, int]:
        """What `assign(slot, length, source, shared)` takes: the shared pages it keeps, the fresh pages it needs,
        and how many of `slot`'s own pages it lets go back to spare."""
        keep = list(self.owned[source][:shared // PAGE]) if shared else []
        freed = sum(1 for p in self.owned[slot] if self.refs[p] == 1 and p not in keep)
        return keep, pages_for(length) - len(keep), freed

    def short(self, slot: int, length: int, source: int | None = None, shared: int = 0) -> int:
        """Pages missing for `assign(slot, length, source, shared)` now (0: it fits)."""
        _, fresh, freed = self._plan(slot, length, source, shared)
        return max(0, fresh - freed - self.free_pages())

    def assign(self, slot: int, length: int, source: int | None = None, shared: int = 0) -> bool:
        """Give `slot` pages for `length` positions: its first `shared` positions are `source`'s pages (the same
        pages: a held prefix; `source` may be `slot`), the others fresh and zeroed; the slot's other pages are let
        go. True if the table or the pools grew (their addresses changed). All or nothing: growing allocates before
        anything is changed, so an allocation that fails (out of memory) leaves the cache as it was."""
        keep, fresh, freed = self._plan(slot, length, source, shared)
        grew = self._grow(fresh - freed - len(self.spare), length)
        for page in keep:
            self.refs[page] += 1
        self.release(slot)
        for _ in range(fresh):
            page = self.spare.pop()
            self.refs[page] = 1
            keep.append(page)
        self.owned[slot] = keep
        self.table[slot] = NULL
        self.table[slot, :len(keep)] = torch.tensor(keep)
        if fresh:
            index = torch.tensor(keep[len(keep) - fresh:], device=self.table.device)
            for store in (self.keys, self.values):
                for pool in store.values():
                    pool[:, index] = 0
        return grew

    def release(self, slot: int, keep: int = 0) -> None:
        """`slot` lets go of its pages past its first `keep` positions (a held prefix stays)."""
        kept, gone = self.owned[slot][:keep // PAGE], self.owned[slot][keep // PAGE:]
        for page in gone:
            self.refs[page] -= 1
            if not self.refs[page]:
                self.spare.append(page)
        self.owned[slot] = kept
        self.table[slot, len(kept):] = NULL

    def _grow(self, pages: int, length: int) -> bool:
        """Room for `pages` more pages (doubling the pools, up to `max_pages`) and table columns for `length`
        positions per slot; True if anything grew."""
        columns = self._columns(length)
        wider = columns > self.table.shape[1]
        if wider:
            columns = max(columns, 2 * self.table.shape[1] - 1)
            if self.max_length is not None:
                columns = max(self._columns(length), min(columns, self._columns(self.max_length)))
        more = pages > 0
        size = self.pages
        if more:
            size = max(self.pages + pages, 2 * self.pages)
            size = min(size, self.max_pages) if self.max_pages is not None else size
        grown = {id(store): {layer: torch.zeros(old.shape[0], size, *old.shape[2:], dtype=old.dtype,
                                                device=old.device)
                             for layer, old in store.items()} for store in (self.keys, self.values)} if more else {}
        table = torch.zeros(self.slots, columns, dtype=torch.long, device=self.table.device) if wider else None
        if more:
            for store in (self.keys, self.values):
                for layer, old in store.items():
                    grown[id(store)][layer][:, :self.pages] = old
                store.update(grown[id(store)])
            self.refs += [0] * (size - self.pages)
            self.spare += range(size - 1, self.pages - 1, -1)
            self.pages = size
        if table is not None:
            table[:, :self.table.shape[1] - 1] = self.table[:, :-1]
            self.table = table
        return more or wider

    def at(self, rows: slice | torch.Tensor, write: torch.Tensor, width: int) -> None:
        """Set the next forward's rows (slots), write positions [rows, tokens] and attended width."""
        self.rows, self.width = rows, width
        table = self.table[rows]
        self.dest = table.gather(1, write // PAGE) * PAGE + write % PAGE
        self.read = table[:, :width // PAGE]
        self._rows: dict[int, torch.Tensor] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx not in self.keys:
            heads, dim = key_states.shape[1], key_states.shape[3]
            self.keys[layer_idx] = key_states.new_zeros(heads, self.pages, PAGE, dim)
            self.values[layer_idx] = value_states.new_zeros(heads, self.pages, PAGE, value_states.shape[3])
        out = []
        rows, pages = self.read.shape
        for pool, states in ((self.keys[layer_idx], key_states), (self.values[layer_idx], value_states)):
            heads, dim = pool.shape[0], pool.shape[3]
            pool.view(heads, -1, dim)[:, self.dest] = states.transpose(0, 1)
            read = pool.view(heads * self.pages, PAGE * dim).index_select(0, self._read_rows(heads))
            out.append(read.view(heads, rows, pages * PAGE, dim).transpose(0, 1))
        return out[0], out[1]

    def _read_rows(self, heads: int) -> torch.Tensor:
        """The pool rows ([heads x pages, PAGE x dim] view) `update` gathers: each head's pages of `read`, head
        first (one flat index_select: several times faster on the CPU than indexing a dimension inside)."""
        if heads not in self._rows:
            offsets = torch.arange(heads, device=self.read.device)[:, None] * self.pages
            self._rows[heads] = (offsets + self.read.flatten()).flatten()
        return self._rows[heads]

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for store in (self.keys, self.values) for t in store.values())

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of keys and values one position of one sequence takes over all layers (full attention everywhere: an
    upper bound for models with sliding-window layers)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return 2 * layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def attention_mask(write: torch.Tensor, limit: torch.Tensor, width: int, dtype: torch.dtype,
                   window: int | None = None) -> torch.Tensor:
    """Additive mask [rows, 1, tokens, width]: the token at position p of a row sees the positions j <= p that hold
    its own tokens (j < `limit` of the row: its prompt length while prefilling, anything once decoding) and
    always itself, so a padding token (written past the prompt, overwritten later) never leaves a row empty.
    `window`: a sliding-window layer's, which also drops j <= p - window (transformers' rule)."""
    j = torch.arange(width, device=write.device)
    p = write[:, :, None]
    seen = (j <= p) & ((j < limit[:, None, None]) | (j == p))
    if window is not None:
        seen &= (j > p - window) | (j == p)
    return torch.zeros(seen.shape, dtype=dtype, device=write.device).masked_fill_(~seen, torch.finfo(dtype).min)[:, None]


def mask_layout(config: Any) -> tuple[int | None, bool]:
    """(sliding window, whether masks go per layer type): a config listing `layer_types` with sliding layers takes
    {"full_attention": ..., "sliding_attention": ...}; one with a `sliding_window` and no layer types (Mistral)
    takes the windowed mask alone; any other the plain one."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return (window, True) if window and "sliding_attention" in types else (None, False)
    return window or None, False
