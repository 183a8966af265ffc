"""`probe attribute --batch-size auto`: preference pairs per batch sized from the GPU's free memory.

Cost model, per pair (two sequences) of padded length L, for a model with `layers` layers, hidden size h, width w at
the hook point (the MLP's width for `mlp.*`), vocabulary V and its dtype's element size e:

    bytes(L) = 2 * L * (layers * (8 * h + 12 * w) * e + 12 * V)

per token and layer, 8 hidden-wide and 12 unit-wide tensors (what autograd keeps for the backward pass, the kept
activations and gradients at the hook, the float64 scoring of one layer), and per token the float32 logits, their
log-softmax and its gradient. For two Llama-3.1-8B-shape bf16 models (h 4096, w 14336, 32 layers, V 128256) that is
14.4 GiB per pair of 528 tokens: about twice the peak measured on an H100 (2 pairs: 42 GiB, ~30 GiB of it weights),
where 4 pairs ran out of memory at 80 GiB. A batch holds as many pairs as FREE_SHARE of the free memory (after the
weights load) pays for at the longest padded length, at least 1; on the CPU, CPU_BATCH. A pair's score does not depend
on its batch (probe/attribution.py), so the batch size changes speed and memory, never the numbers.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rolemrc.core.hooks import num_layers, width

log = logging.getLogger(__name__)

FREE_SHARE = 0.8   # of the GPU memory free once both models are loaded
CPU_BATCH = 4      # pairs per batch on the CPU, where memory is not measured
GIB = 2 ** 30


def pair_bytes(model: Any, hook: str, length: int) -> int:
    """The cost model's bytes of one preference pair padded to `length` tokens (module docstring)."""
    config = model.config
    element = next(model.parameters()).element_size()
    per_token = num_layers(model) * (8 * config.hidden_size + 12 * width(model, hook)) * element + 12 * config.vocab_size
    return 2 * length * per_token


def pairs_that_fit(free: int, cost: int) -> int:
    """Pairs of `cost` bytes each that FREE_SHARE of `free` bytes holds, at least 1."""
    return max(1, int(FREE_SHARE * free // cost))


def auto_batch_size(model: Any, hook: str, length: int) -> int:
    """Pairs per batch for `model` (the one backpropagated) at padded length `length`: from the free memory of its
    GPU, or CPU_BATCH on the CPU; the choice and why are logged."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        log.info("attribute: %d pairs per batch (on the CPU, memory is not measured)", CPU_BATCH)
        return CPU_BATCH
    free = torch.cuda.mem_get_info(device)[0]
    cost = pair_bytes(model, hook, length)
    pairs = pairs_that_fit(free, cost)
    log.info("attribute: %d pairs per batch: %.1f GiB free on %s, ~%.2f GiB per pair of %d tokens (cost model in "
             "rolemrc.probe.memory), %.0f%% of the free memory used", pairs, free / GIB, device, cost / GIB, length,
             100 * FREE_SHARE)
    return pairs
