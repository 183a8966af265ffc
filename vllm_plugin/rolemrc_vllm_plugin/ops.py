"""Grouped LoRA ops for vLLM's CPU (torch) backend, drop-in for `vllm.lora.ops.torch_ops`: same names, same
arguments, same results where vLLM's are right.

vLLM's torch ops gather every token's adapter matrices (tokens x rank x width) and einsum them, even for tokens
without an adapter, and index the adapter stack with the token's slot, where "no adapter" is -1: Python reads it as
the last slot, so such a token gets the last adapter's product. Here tokens are grouped by slot: one matmul per
active adapter over its tokens, a gather of input columns when the adapter's A is one-hot (a restraint on
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


def _grouped(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype,
             gather: bool) -> torch.Tensor:
    """[tokens, out]: token i times weights[indices[i]]^T, 0 where indices[i] < 0; one product per active slot."""
    stack = _matrices(weights)
    out = torch.zeros(inputs.shape[0], stack.shape[1], dtype=dtype, device=inputs.device)
    indices = indices[: inputs.shape[0]]
    for slot in torch.unique(indices).tolist():
        if slot < 0:
            continue
        rows = (indices == slot).nonzero().squeeze(1)
        columns = _one_hot_columns(stack, slot) if gather else None
        x = inputs.index_select(0, rows).to(dtype)
        if columns is None:
            out[rows] = x @ stack[slot].to(dtype).t()
        else:   # a column gather; padding rows (-1) give 0
            out[rows] = x[:, columns.clamp(min=0)] * (columns >= 0).to(dtype)
    return out


def _rows_match(inputs: torch.Tensor, output: torch.Tensor, indices: torch.Tensor) -> bool:
    """Shapes the grouped path handles: one index per row of `inputs`, as many rows as the output."""
    return inputs.shape[0] == output.shape[0] and indices.shape[0] >= inputs.shape[0]


def bgmv_shrink(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, scaling: float = 1.0) -> None:
    if not _rows_match(inputs, output_tensor, lora_indices_tensor):
        return ORIGINAL["bgmv_shrink"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
    outputs = _grouped(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype, gather=True)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, add_inputs: bool = True) -> None:
    if not _rows_match(inputs, output_tensor, lora_indices_tensor):
        return ORIGINAL["bgmv_expand"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
    outputs = _grouped(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype, gather=False)
    common = min(outputs.shape[1], output_tensor.shape[1])   # adapter and model may pad differently
    if add_inputs:
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
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = outputs


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
