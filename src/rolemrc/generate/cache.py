"""The engine's KV cache: one preallocated slot per running request, written in place at each row's own positions.

Every attention layer of a transformers model hands its new keys and values to `cache.update` and attends over what
it returns, so any such architecture decodes through this cache unchanged. Before each forward the engine says which
slots the batch rows are (`rows`), where each row's tokens go (`write`, [rows, tokens]) and how many positions to
attend over (`width`); the mask (`attention_mask`) says which of those a token sees. Rows join and leave by slot: nothing
is concatenated, re-padded or copied per step, and the decode step's tensors keep their addresses (CUDA graphs).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

GRAIN = 128   # positions are allocated and attended over in multiples of this


def round_up(n: int, grain: int = GRAIN) -> int:
    return -(-n // grain) * grain


class SlotCache(Cache):
    """Keys and values [slots, kv_heads, length, head_dim] per layer, allocated on a layer's first write (so each
    layer's heads and dims are its own) and grown by `reserve`."""

    is_compileable = False

    def __init__(self, slots: int, length: int) -> None:
        super().__init__(layers=[])
        self.slots, self.length = slots, round_up(length)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.rows: slice | torch.Tensor = slice(0, 0)    # the batch rows' slots: a contiguous run or an index
        self.row_index = torch.empty(0, dtype=torch.long)   # the same as an index [rows]
        self.write = torch.empty(0, 0, dtype=torch.long)   # [rows, tokens] positions the new keys go to
        self.width = 0

    def reserve(self, length: int, limit: int | None = None) -> bool:
        """Room for `length` positions per slot (kept rows' keys copied into the larger buffers), doubling up to
        `limit` positions; True if it grew. All or nothing: every layer's new buffers are made before any replaces
        its old one, so an allocation that fails (out of memory) leaves the cache as it was."""
        if length <= self.length:
            return False
        new = max(round_up(length), 2 * self.length)
        new = max(round_up(length), min(new, round_up(limit))) if limit is not None else new
        grown = {id(store): {} for store in (self.keys, self.values)}
        for store in (self.keys, self.values):
            for layer, old in store.items():
                grown[id(store)][layer] = torch.zeros(*old.shape[:2], new, old.shape[3], dtype=old.dtype,
                                                      device=old.device)
        for store in (self.keys, self.values):
            for layer, old in store.items():
                grown[id(store)][layer][:, :, :self.length] = old
            store.update(grown[id(store)])
        self.length = new
        return True

    def at(self, rows: slice | torch.Tensor, write: torch.Tensor, width: int) -> None:
        """Set the next forward's rows (slots), write positions [rows, tokens] and attended width."""
        self.rows, self.write, self.width = rows, write, width
        self.row_index = (torch.arange(rows.start, rows.stop, device=write.device) if isinstance(rows, slice)
                          else rows)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx not in self.keys:
            shape = (self.slots, key_states.shape[1], self.length, key_states.shape[3])
            self.keys[layer_idx] = key_states.new_zeros(shape)
            self.values[layer_idx] = value_states.new_zeros(*shape[:3], value_states.shape[3])
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        index = self.row_index[:, None]
        keys[index, :, self.write] = key_states.transpose(1, 2)
        values[index, :, self.write] = value_states.transpose(1, 2)
        return keys[self.rows, :, :self.width], values[self.rows, :, :self.width]

    def copy(self, src: int, dst: int, length: int) -> None:
        """Slot `dst`'s first `length` positions become slot `src`'s (every layer)."""
        for store in (self.keys, self.values):
            for t in store.values():
                t[dst, :, :length] = t[src, :, :length]

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
