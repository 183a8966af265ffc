"""Grouped LoRA ops for vLLM's CPU (torch) backend, drop-in for `vllm.lora.ops.torch_ops`: same names, same
arguments, same results where vLLM's are right.

vLLM's torch ops gather every token's adapter matrices (tokens x rank x width) and einsum them, even for tokens
without an adapter, and index the adapter stack with the token's slot, where "no adapter" is -1: Python reads it as
the last slot, so such a token gets the last adapter's product. Here:
- a batch's token -> slot map is read once per forward pass (`Batch`), not once per layer: every LoRA layer of a
  step gets the same index tensor, and vLLM rewrites it in place between steps (its version counter says when);
- a layer whose adapter stack is zero for every slot in the batch (a module no active adapter touches) costs nothing;
- a one-hot A (a restraint on `mlp.act`/`mlp.post` selects units) is a gather of each token's own input columns;
- otherwise every active adapter runs in one matmul, each token keeping its own block (`Batch.select`); a batch of
  more than BLOCK_TOKENS tokens with several adapters (a long prefill) runs one matmul per adapter over its tokens;
- -1 tokens get what a zero adapter gives: nothing added (shrink writes 0, expand adds 0; a non-accumulating expand
  writes 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

BLOCK_TOKENS = 256   # up to this many tokens, every active adapter in one matmul (k times the FLOPs of one, no loop)
CACHE_SIZE = 1024    # derived tensors kept (per stack and per batch map); cleared when full
FLAT_KEPT = 8        # per stack, the side-by-side matrices of this many sets of active adapters (a set per batch mix)


def _matrices(weights: torch.Tensor) -> torch.Tensor:
    """The adapter stack as [slots, out, in] (vLLM keeps a singleton second axis)."""
    return weights.squeeze(1) if weights.dim() == 4 else weights


DERIVED: dict[tuple, tuple[tuple, tuple, Any]] = {}   # (kind, addresses, shapes, dtypes) -> (tensors, versions, value)


def derived(kind: Callable[..., Any], *tensors: torch.Tensor) -> Any:
    """`kind(*tensors)`, kept while the tensors keep their versions (vLLM writes adapters and batch maps in place).
    The entry holds the tensors, so their addresses cannot be reused by other tensors while it exists. Inference
    tensors keep no version, so what derives from them is not kept."""
    if any(t.is_inference() for t in tensors):
        return kind(*tensors)
    key = (kind, *((t.data_ptr(), tuple(t.shape), t.dtype) for t in tensors))
    versions = tuple(t._version for t in tensors)
    hit = DERIVED.get(key)
    if hit is not None and hit[1] == versions:
        return hit[2]
    if len(DERIVED) >= CACHE_SIZE:
        DERIVED.clear()
    value = kind(*tensors)
    DERIVED[key] = (tensors, versions, value)
    return value


class Batch:
    """One batch's token -> adapter slot map, as every LoRA layer of a forward pass uses it."""

    def __init__(self, slots: torch.Tensor) -> None:
        self.slots = slots
        present = torch.unique(slots)
        active = present[present >= 0]
        self.active = active.tolist()
        self.key = tuple(self.active)
        self.all_one = len(self.active) == 1 and bool((slots == self.active[0]).all())   # no -1 token, one adapter
        # each token's position among the active slots; -1 tokens get len(active), a row that selects nothing
        self.position = torch.where(slots >= 0, torch.searchsorted(active, slots.clamp(min=0)), len(self.active))
        self._select: dict[torch.dtype, torch.Tensor] = {}

    def select(self, dtype: torch.dtype) -> torch.Tensor:
        """[tokens, active, 1]: 1 at each token's adapter, all 0 for a -1 token."""
        if dtype not in self._select:
            k = len(self.active)
            self._select[dtype] = torch.nn.functional.one_hot(self.position, k + 1)[:, :k, None].to(dtype)
        return self._select[dtype]


class Stack:
    """What the grouped ops need of one adapter stack [slots, out, in], computed once per version of it."""

    def __init__(self, stack: torch.Tensor) -> None:
        self.stack = stack
        self.nonzero = set(stack.flatten(1).ne(0).any(1).nonzero().flatten().tolist())
        self._columns: torch.Tensor | None = None   # each slot's column per row of A, when first asked (`gathers`)
        self._one_hot: set[int] = set()
        self._flat: dict[tuple, torch.Tensor] = {}
        self._gather: tuple[Batch, torch.Tensor, torch.Tensor] | None = None

    def gathers(self, batch: Batch) -> bool:
        """Whether every adapter of `batch` has a one-hot A here: each row a single 1 or nothing (rank padding)."""
        if self._columns is None:
            ones = self.stack == 1
            per_row = ones.sum(2)
            one_hot = ((per_row <= 1) & (ones | (self.stack == 0)).all(2)).all(1)
            columns = torch.where(per_row == 1, ones.to(torch.int8).argmax(2), -1)
            # the extra last slot, for -1 tokens, selects nothing
            self._columns = torch.cat([columns, columns.new_full((1, columns.shape[1]), -1)])
            self._one_hot = set(one_hot.nonzero().flatten().tolist())
        return self._one_hot.issuperset(batch.active)

    def gather_index(self, batch: Batch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's input columns [tokens, rows] (0 where padding) and the mask of real ones, for this batch of
        one-hot adapters (`gathers`)."""
        if self._gather is None or self._gather[0] is not batch or self._gather[2].dtype != dtype:
            columns = self._columns[torch.where(batch.slots >= 0, batch.slots, self.stack.shape[0])]
            self._gather = (batch, columns.clamp(min=0), (columns >= 0).to(dtype))
        return self._gather[1], self._gather[2]

    def flat(self, slots: tuple[int, ...], dtype: torch.dtype, shrink: bool) -> torch.Tensor:
        """The slots' matrices side by side, in `dtype`: for a shrink [in, slots x out] (x @ it gives each slot's
        block), for an expand [slots x in, out] (a token's input placed in its slot's block @ it gives its product)."""
        key = (slots, dtype, shrink)
        if key not in self._flat:
            if len(self._flat) >= FLAT_KEPT:
                self._flat.clear()
            m = self.stack[list(slots)].to(dtype)
            self._flat[key] = m.reshape(-1, m.shape[2]).t() if shrink else m.transpose(1, 2).reshape(-1, m.shape[1])
        return self._flat[key]


def _shrink(x: torch.Tensor, info: Stack, batch: Batch, dtype: torch.dtype, slots: tuple[int, ...]) -> torch.Tensor:
    """[tokens, rank]: each token's input times its adapter's A^T (0 for a token of no adapter in `batch`)."""
    if info.gathers(batch):
        columns, real = info.gather_index(batch, dtype)
        return x.gather(1, columns).to(dtype) * real
    blocks = x.to(dtype) @ info.flat(slots, dtype, shrink=True)
    if batch.all_one:
        return blocks
    return (blocks.view(x.shape[0], len(slots), -1) * batch.select(dtype)).sum(1)


def _expand(x: torch.Tensor, info: Stack, batch: Batch, dtype: torch.dtype, slots: tuple[int, ...]) -> torch.Tensor:
    """[tokens, out]: each token's input times its adapter's B^T (0 for a token of no adapter in `batch`)."""
    x = x.to(dtype)
    if not batch.all_one:
        x = (x[:, None, :] * batch.select(dtype)).view(x.shape[0], -1)
    return x @ info.flat(slots, dtype, shrink=False)


def _grouped(inputs: torch.Tensor, weights: torch.Tensor, batch: Batch, dtype: torch.dtype,
             shrink: bool) -> torch.Tensor | None:
    """[tokens, out]: token i times weights[slot i]^T, 0 for a slot < 0; None when no token's adapter has anything in
    this stack."""
    stack = _matrices(weights)
    n = inputs.shape[0]
    info = derived(Stack, stack)
    if info.nonzero.isdisjoint(batch.active):
        return None
    product = _shrink if shrink else _expand
    if n <= BLOCK_TOKENS or len(batch.active) == 1 or (shrink and info.gathers(batch)):
        return product(inputs, info, batch, dtype, batch.key)
    out = torch.zeros(n, stack.shape[1], dtype=dtype, device=inputs.device)
    for slot in batch.active:   # a long prefill of several adapters: one product per adapter over its own tokens
        rows = (batch.slots == slot).nonzero().squeeze(1)
        out[rows] = product(inputs.index_select(0, rows), info, Batch(batch.slots[rows]), dtype, (slot,))
    return out


def _decode_batch(indices: torch.Tensor, tokens: int) -> Batch:
    """The batch of a per-token slot map (vLLM's persistent one: read once per step)."""
    return derived(Batch, indices[:tokens])


def _prefill_batch(slots: torch.Tensor, lengths: torch.Tensor) -> Batch:
    """The batch of per-sequence slots and lengths (prefill metadata)."""
    return Batch(torch.repeat_interleave(slots, lengths))


def _shrink_into(inputs: torch.Tensor, weights: torch.Tensor, output: torch.Tensor, batch: Batch,
                 scaling: float) -> None:
    outputs = _grouped(inputs, weights, batch, output.dtype, shrink=True)
    target = output[:, :_matrices(weights).shape[1]]
    if outputs is None:
        target.zero_()
    else:
        target.copy_(outputs if scaling == 1.0 else outputs * scaling)


def _expand_into(inputs: torch.Tensor, weights: torch.Tensor, target: torch.Tensor, batch: Batch,
                 add_inputs: bool) -> None:
    """An expand's result into its slice of the output: added, or written (a -1 token's: 0)."""
    outputs = _grouped(inputs, weights, batch, target.dtype, shrink=False)
    if outputs is None:
        if not add_inputs:
            target.zero_()
    elif add_inputs:
        target += outputs[:, :target.shape[1]]
    else:
        target.copy_(outputs[:, :target.shape[1]])


def _expand_width(weights: torch.Tensor, output: torch.Tensor) -> int:
    """Columns an expand writes: adapter and model may pad differently."""
    return min(_matrices(weights).shape[1], output.shape[1])


def _handled(inputs: torch.Tensor, output: torch.Tensor, tokens: int) -> bool:
    """Shapes the grouped path handles: a slot for each row of `inputs`, as many rows as the output."""
    return inputs.shape[0] == output.shape[0] and tokens >= inputs.shape[0]


def bgmv_shrink(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, scaling: float = 1.0) -> None:
    if not _handled(inputs, output_tensor, lora_indices_tensor.shape[0]):
        return ORIGINAL["bgmv_shrink"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
    _shrink_into(inputs, lora_b_weights, output_tensor, _decode_batch(lora_indices_tensor, inputs.shape[0]), scaling)


def bgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, add_inputs: bool = True) -> None:
    if not _handled(inputs, output_tensor, lora_indices_tensor.shape[0]):
        return ORIGINAL["bgmv_expand"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
    _expand_into(inputs, lora_b_weights, output_tensor[:, :_expand_width(lora_b_weights, output_tensor)],
                 _decode_batch(lora_indices_tensor, inputs.shape[0]), add_inputs)


def bgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                      lora_indices_tensor: torch.Tensor, slice_offset: int, slice_size: int,
                      add_inputs: bool = True) -> None:
    if not _handled(inputs, output_tensor, lora_indices_tensor.shape[0]):
        return ORIGINAL["bgmv_expand_slice"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset,
                                             slice_size, add_inputs)
    _expand_into(inputs, lora_b_weights, output_tensor[:, slice_offset: slice_offset + slice_size],
                 _decode_batch(lora_indices_tensor, inputs.shape[0]), add_inputs)


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor, batches,
                max_seq_length, token_nums, scaling):
    batch = derived(_prefill_batch, lora_indices_tensor, seq_len_tensor)
    if not _handled(inputs, output_tensor, batch.slots.shape[0]):
        return ORIGINAL["sgmv_shrink"](inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                                       lora_indices_tensor, batches, max_seq_length, token_nums, scaling)
    _shrink_into(inputs, lora_a_weights, output_tensor, batch, scaling)


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor, batches,
                max_seq_length, token_nums, add_inputs=False):
    batch = derived(_prefill_batch, lora_indices_tensor, seq_len_tensor)
    if not _handled(inputs, output_tensor, batch.slots.shape[0]):
        return ORIGINAL["sgmv_expand"](inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                                       lora_indices_tensor, batches, max_seq_length, token_nums, add_inputs)
    _expand_into(inputs, lora_b_weights, output_tensor[:, :_expand_width(lora_b_weights, output_tensor)], batch,
                 add_inputs)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                      batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs=False):
    batch = derived(_prefill_batch, lora_indices_tensor, seq_len_tensor)
    if not _handled(inputs, output_tensor, batch.slots.shape[0]):
        return ORIGINAL["sgmv_expand_slice"](inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                                             lora_indices_tensor, batches, max_seq_length, token_nums, slice_offset,
                                             slice_size, add_inputs)
    _expand_into(inputs, lora_b_weights, output_tensor[:, slice_offset: slice_offset + slice_size], batch, add_inputs)


OPS = {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice,
       "sgmv_shrink": sgmv_shrink, "sgmv_expand": sgmv_expand, "sgmv_expand_slice": sgmv_expand_slice}
ORIGINAL: dict = {}   # vLLM's own ops, filled when the plugin replaces them (shapes the grouped path leaves to them)
