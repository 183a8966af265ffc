"""Run inside the vLLM environment (tests/test_vllm_plugin.py): rolemrc's grouped LoRA ops against vLLM's own torch ops
on random inputs: several adapters of dense and one-hot A, rank padding, tokens without an adapter (slot -1),
prefill (sgmv: per sequence) and decode (bgmv: per token) shapes, accumulating or not. Equal to float32 tolerance
on every row with an adapter; on -1 rows, where vLLM's ops use the last slot, the grouped ones must give what a zero
adapter gives (the output untouched, a shrink of 0). Then the way vLLM calls them: bfloat16, under inference mode,
one persistent slot map rewritten in place between steps and adapters loaded into a stack in place (what the ops
keep per batch and per stack must follow both), and a module no active adapter touches (zero stacks). Prints one
JSON line of counts."""

from __future__ import annotations

import json
import sys

import torch
from rolemrc_vllm_plugin import ops

ORIGINAL = ops.ORIGINAL or {name: getattr(__import__("vllm.lora.ops.torch_ops.lora_ops", fromlist=[name]), name)
                            for name in ops.OPS}


def stacks(g: torch.Generator, slots: int, rank: int, hidden: int, out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [slots, 1, rank, hidden] (even slots one-hot with rank padding, odd ones dense), B [slots, 1, out, rank]."""
    a = torch.randn(slots, 1, rank, hidden, generator=g)
    for s in range(0, slots, 2):
        used = rank - s % 3   # the last rows pad
        a[s] = 0
        a[s, 0, torch.arange(used), torch.randperm(hidden, generator=g)[:used]] = 1
    return a, torch.randn(slots, 1, out, rank, generator=g)


def compare(name: str, before: tuple, after: tuple, indices: torch.Tensor, output: torch.Tensor,
            zero_adapter: torch.Tensor, tally: dict, tolerance: float = 1e-5) -> None:
    """`op(*before, out, *after)` with vLLM's op and with the grouped one, each on a copy of `output`: equal on rows
    with an adapter; on -1 rows the grouped one must give `zero_adapter` (what an all-zero adapter gives)."""
    theirs, ours = output.clone(), output.clone()
    ORIGINAL[name](*before, theirs, *after)
    ops.OPS[name](*before, ours, *after)
    has = indices >= 0
    close = torch.allclose(ours[has].float(), theirs[has].float(), rtol=tolerance, atol=tolerance)
    right = torch.equal(ours[~has], zero_adapter[~has])
    tally["cases"] += 1
    tally["rows_with_adapter"] += int(has.sum())
    tally["rows_without"] += int((~has).sum())
    tally["original_wrong_on_minus_one"] += int(bool((~has).any()) and not torch.equal(theirs[~has], zero_adapter[~has]))
    if not (close and right):
        tally["failures"].append({"op": name, "equal_on_adapter_rows": close, "minus_one_rows_right": right,
                                  "max_abs": float((ours[has].float() - theirs[has].float()).abs().max()) if has.any() else 0.0})


def as_vllm_calls_them(g: torch.Generator, tally: dict) -> None:
    """Steps of a served batch: vLLM's persistent slot map (bgmv) and per-sequence metadata (sgmv) rewritten in place,
    adapters written into the stacks in place between steps, bfloat16 model outputs, inference mode, and a second
    module whose stacks are zero (an o_proj no restraint folds into)."""
    slots, rank, hidden, out, tokens = 4, 16, 64, 48, 24
    a, b = stacks(g, slots, rank, hidden, out)
    a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
    zero_a, zero_b = torch.zeros_like(a), torch.zeros_like(b)
    token_map = torch.full((64,), -1, dtype=torch.long)    # vLLM's _token_lora_indices
    seq_slots, seq_lengths = torch.zeros(8, dtype=torch.long), torch.zeros(8, dtype=torch.long)
    with torch.inference_mode():
        for step in range(8):
            if step == 4:   # a new adapter loaded into slot 1 in place (one-hot), and slot 3 emptied
                a[1].zero_()
                a[1, 0, torch.arange(rank), torch.randperm(hidden, generator=g)[:rank]] = 1
                b[1].copy_(torch.randn(1, out, rank, generator=g))
                a[3].zero_()
                b[3].zero_()
            n = tokens - step // 2   # two steps of each size: the same shapes, rewritten in place
            token_map[:n].copy_(torch.randint(-1, slots, (n,), generator=g))
            idx = token_map[:n]
            x = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
            shrunk, stale = torch.zeros(n, rank), torch.randn(n, rank, generator=g)
            buffer = torch.randn(n, rank, generator=g)
            base = torch.randn(n, out, generator=g).to(torch.bfloat16)
            for stack_a, stack_b in ((a, b), (zero_a, zero_b)):
                compare("bgmv_shrink", (x, stack_a), (idx, 1.0), idx, stale, shrunk, tally, tolerance=1e-2)
                compare("bgmv_expand_slice", (buffer, stack_b), (idx, 0, out, True), idx, base, base, tally,
                        tolerance=5e-2)
            seq_slots[:3].copy_(torch.randint(-1, slots, (3,), generator=g))
            seq_lengths[:3].copy_(torch.tensor([n // 3, n // 3, n - 2 * (n // 3)]))
            meta = (torch.cumsum(seq_lengths[:3], 0) - seq_lengths[:3], seq_lengths[:3], seq_slots[:3], 3,
                    int(seq_lengths.max()), n)
            per_token = torch.repeat_interleave(seq_slots[:3], seq_lengths[:3])
            compare("sgmv_shrink", (x, a), (*meta, 1.0), per_token, stale, shrunk, tally, tolerance=1e-2)
            compare("sgmv_expand_slice", (buffer, b), (*meta, 0, out, True), per_token, base, base, tally,
                    tolerance=5e-2)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    tally = {"cases": 0, "rows_with_adapter": 0, "rows_without": 0, "original_wrong_on_minus_one": 0, "failures": []}
    # decode-sized batches (every adapter in one matmul) and one over BLOCK_TOKENS (one product per adapter)
    for slots, rank, hidden, out, tokens in ((1, 8, 32, 48, 5), (4, 16, 64, 96, 23), (3, 32, 96, 64, 40), (3, 16, 64, 48, 300)):
        a, b = stacks(g, slots, rank, hidden, out)
        x = torch.randn(tokens, hidden, generator=g)
        shrunk, stale = torch.zeros(tokens, rank), torch.randn(tokens, rank, generator=g)   # a buffer's old values
        for minus_one_share in (0.0, 0.4, 1.0):
            idx = torch.randint(0, slots, (tokens,), generator=g)
            idx[torch.rand(tokens, generator=g) < minus_one_share] = -1
            buffer = torch.randn(tokens, rank, generator=g)
            base = torch.randn(tokens, out + 3, generator=g)   # the model's output (wider: padding differs)
            replaced = torch.cat([torch.zeros(tokens, out), base[:, out:]], 1)   # a zero adapter's, not accumulated
            sliced = torch.cat([base[:, :2], torch.zeros(tokens, out), base[:, 2 + out:]], 1)
            compare("bgmv_shrink", (x, a), (idx, 0.5), idx, stale, shrunk, tally)
            for add in (True, False):
                compare("bgmv_expand", (buffer, b), (idx, add), idx, base, base if add else replaced, tally)
                compare("bgmv_expand_slice", (buffer, b), (idx, 2, out, add), idx, base, base if add else sliced, tally)
            # prefill: sequences of several tokens, one slot each
            lengths = torch.tensor([tokens // 3, tokens // 3, tokens - 2 * (tokens // 3)])
            per_seq = torch.randint(-1, slots, (3,), generator=g)
            meta = (torch.cumsum(lengths, 0) - lengths, lengths, per_seq, 3, int(lengths.max()), tokens)
            per_token = torch.repeat_interleave(per_seq, lengths)
            compare("sgmv_shrink", (x, a), (*meta, 2.0), per_token, stale, shrunk, tally)
            compare("sgmv_expand", (buffer, b), (*meta, True), per_token, base, base, tally)
            compare("sgmv_expand_slice", (buffer, b), (*meta, 1, out, True), per_token, base, base, tally)
    as_vllm_calls_them(g, tally)
    print(json.dumps(tally))
    sys.exit(1 if tally["failures"] else 0)


if __name__ == "__main__":
    main()
