"""Grouped LoRA ops for vLLM's CPU (torch) backend, drop-in for `vllm.lora.ops.torch_ops`: same names, same
arguments, same results where vLLM's are right.

vLLM's torch ops gather every token's adapter matrices (tokens x rank x width) and einsum them, even for tokens
without an adapter, and index the adapter stack with the token's slot, where "no adapter" is -1: Python reads it as
the last slot, so such a token gets the last adapter's product. Here tokens are grouped by slot: one matmul per
active adapter over its tokens (for a decode step's few tokens, every active adapter in one matmul, each token
keeping its own block), a gather of input columns when the adapter's A is one-hot (a restraint on
`mlp.act`/`mlp.post` selects units), and -1 tokens get what a zero adapter gives: nothing added (shrink writes 0,
expand adds 0; a non-accumulating expand writes 0).
"""

from __future__ import annotations

import torch


def _matrices(weights: torch.Tensor) -> torch.Tensor:
    """The adapter stack as [slots, out, in] (vLLM keeps a singleton second axis)."""
    return weights.squeeze(1) if weights.dim() == 4 else weights


GATHERS: dict[tuple, tuple[int, torch.Tensor | None]] = {}   # (address, slot, shape) -> (version, columns)


def _one_hot_columns(stack: torch.Tensor, slot: int) -> torch.Tensor | None:
    """For an A whose rows each hold a single 1 or nothing (rank padding), the rest 0: the column of each row (-1 for
    a padding row), else None. Cached while the stack keeps its version: vLLM writes adapters into it in place."""
    key, version = (stack.data_ptr(), slot, tuple(stack.shape)), stack._version
    if key in GATHERS and GATHERS[key][0] == version:
        return GATHERS[key][1]
    a = stack[slot]
    ones = a == 1
    per_row = ones.sum(1)
    columns = None
    if bool((per_row <= 1).all()) and bool(((a == 0) | ones).all()):
        columns = torch.where(per_row == 1, ones.to(torch.int8).argmax(1), -1)
    GATHERS[key] = (version, columns)
    return columns


BLOCK_TOKENS = 256   # up to this many tokens (decode steps): every active adapter in one matmul, each token keeping
# its own block; above it (prefill), one matmul (or gather) per adapter over its own tokens


def _product(x: torch.Tensor, stack: torch.Tensor, slot: int, dtype: torch.dtype, gather: bool) -> torch.Tensor:
    """x times stack[slot]^T: a column gather where that A is one-hot (padding rows give 0), else a matmul."""
    columns = _one_hot_columns(stack, slot) if gather else None
    if columns is None:
        return x.to(dtype) @ stack[slot].to(dtype).t()
    return x[:, columns.clamp(min=0)].to(dtype) * (columns >= 0).to(dtype)


def _grouped(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype,
             gather: bool) -> torch.Tensor | None:
    """[tokens, out]: token i times weights[indices[i]]^T, 0 where indices[i] < 0; None when no token has an
    adapter. One product when every token has the same adapter."""
    stack = _matrices(weights)
    n = inputs.shape[0]
    indices = indices[:n]
    active = torch.unique(indices)
    active = active[active >= 0]
    if len(active) == 0:
        return None
    if len(active) == 1 and bool((indices == active[0]).all()):
        return _product(inputs, stack, int(active[0]), dtype, gather)
    if n <= BLOCK_TOKENS:
        k, width = len(active), stack.shape[1]
        blocks = (inputs.to(dtype) @ stack[active].to(dtype).reshape(k * width, -1).t()).view(n, k, width)
        out = blocks[torch.arange(n), torch.searchsorted(active, indices.clamp(min=0))]
        out[indices < 0] = 0
        return out
    out = torch.zeros(n, stack.shape[1], dtype=dtype, device=inputs.device)
    for slot in active.tolist():
        rows = (indices == slot).nonzero().squeeze(1)
        out[rows] = _product(inputs.index_select(0, rows), stack, slot, dtype, gather)
    return out


def _rows_match(inputs: torch.Tensor, output: torch.Tensor, indices: torch.Tensor) -> bool:
    """Shapes the grouped path handles: one index per row of `inputs`, as many rows as the output."""
    return inputs.shape[0] == output.shape[0] and indices.shape[0] >= inputs.shape[0]


def bgmv_shrink(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, scaling: float = 1.0) -> None:
    if not _rows_match(inputs, output_tensor, lora_indices_tensor):
        return ORIGINAL["bgmv_shrink"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
    outputs = _grouped(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype, gather=True)
    rank = _matrices(lora_b_weights).shape[1]
    output_tensor[:, :rank] = 0 if outputs is None else scaling * outputs


def bgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, add_inputs: bool = True) -> None:
    if not _rows_match(inputs, output_tensor, lora_indices_tensor):
        return ORIGINAL["bgmv_expand"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
    outputs = _grouped(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype, gather=False)
    common = min(_matrices(lora_b_weights).shape[1], output_tensor.shape[1])   # adapter and model may pad differently
    if outputs is None:   # no token has an adapter: nothing to add
        if not add_inputs:
            output_tensor[:, :common] = 0
    elif add_inputs:
        output_tensor[:, :common] += outputs[:, :common]
    else:
        output_tensor[:, :common] = outputs[:, :common]


def bgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                      lora_indices_tensor: torch.Tensor, slice_offset: int, slice_size: int,
                      add_inputs: bool = True) -> None:
    if not _rows_match(inputs, output_tensor, lora_indices_tensor):
        return ORIGINAL["bgmv_expand_slice"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset,
                                             slice_size, add_inputs)
    outputs = _grouped(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype, gather=False)
    target = output_tensor[:, slice_offset: slice_offset + slice_size]
    if outputs is None:   # no token has an adapter: nothing to add
        if not add_inputs:
            target.zero_()
    elif add_inputs:
        target += outputs
    else:
        target.copy_(outputs)


def _tokens(lora_indices_tensor: torch.Tensor, seq_len_tensor: torch.Tensor) -> torch.Tensor:
    """Each token's slot from each sequence's (prefill metadata)."""
    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor, batches,
                max_seq_length, token_nums, scaling):
    bgmv_shrink(inputs, lora_a_weights, output_tensor, _tokens(lora_indices_tensor, seq_len_tensor), scaling)


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor, batches,
                max_seq_length, token_nums, add_inputs=False):
    bgmv_expand(inputs, lora_b_weights, output_tensor, _tokens(lora_indices_tensor, seq_len_tensor), add_inputs)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                      batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs=False):
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, _tokens(lora_indices_tensor, seq_len_tensor),
                      slice_offset, slice_size, add_inputs)


OPS = {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice,
       "sgmv_shrink": sgmv_shrink, "sgmv_expand": sgmv_expand, "sgmv_expand_slice": sgmv_expand_slice}
ORIGINAL: dict = {}   # vLLM's own ops, filled when the plugin replaces them (shapes the grouped path leaves to them)
