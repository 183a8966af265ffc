"""Chosen against rejected: one model's mean activations on each side of preference pairs (`rolemrc intervene direction
--contrast chosen-rejected`).

Each pair's prompt + chosen reply and prompt + rejected reply run through the model, tokenised as trl's DPOTrainer
does and batched by length as attribution batches them (`attribution.build_pairs`, `pair_batches`). Both sequences
share the prompt, so at the last prompt token they are identical; a side's activation is the mean over its reply's
tokens (the template's end-of-turn tokens included): those are the positions DPO's margin sums over, and those where a
restraint acts while the model writes a reply. The last reply token alone would be the end-of-turn token, after which
nothing is generated, and one noisy token per reply. Each pair counts once, however long its replies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from rolemrc.core.hooks import num_layers, width
from rolemrc.core.records import first_cases
from rolemrc.probe.attribution import AttributeConfig, Pairs, build_pairs, pair_batches, read_pairs
from rolemrc.probe.backends import TorchBackend
from rolemrc.probe.cases import case_dimensions, pad_right
from rolemrc.probe.collect import load_probed, resolve_named, shared_window
from rolemrc.probe.errors import ProbeError
from rolemrc.probe.memory import auto_batch_size

REPLY_TOKENS = "the mean over each reply's tokens (end-of-turn tokens included)"   # where a side's activation is read


@dataclass
class ReplyMeans:
    """float64 [layers, width]: the mean over pairs of each chosen and each rejected reply's mean activation at `hook`;
    the pairs they average, the model's identity (`collect.load_probed`) and where the pairs came from."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    pairs: int
    hook: str
    model: dict[str, str]
    origin: str

    @property
    def delta(self) -> torch.Tensor:
        """Mean chosen - mean rejected, per layer and unit."""
        return self.chosen - self.rejected


def reply_means(model: Any, data: Any, config: AttributeConfig | None = None, *, dimension: str | None = None,
                tokenizer: Any = None, **overrides: Any) -> ReplyMeans:
    """The chosen and rejected sides' mean activations of `model` (a model name, or a loaded causal LM with its
    `tokenizer`) over the preference pairs `data` (a JSONL path or pair records), those of `dimension` alone when
    given. Settings as attribution's (`config`, keyword overrides: hook, batch size, max length, limit, dimension
    field, dtype, device); its resamples are not drawn. Inputs are checked before the model loads."""
    config = AttributeConfig(**{**asdict(config or AttributeConfig()), "resamples": 0, **overrides})
    model = resolve_named(model)
    records, fingerprint = read_pairs(data)
    records = first_cases(records, config.limit)
    if dimension is not None:
        records = [r for r in records if dimension in case_dimensions(r, config.dimension_field)]
        if not records:
            raise ProbeError(f"{data if fingerprint else 'the pairs'}: no pair of {dimension!r}")
    model, tokenizer, meta = load_probed(model, tokenizer, config)
    cap = shared_window([model], tokenizer, config.max_length)
    pairs = build_pairs(records, tokenizer, dimension_field=config.dimension_field, max_length=cap)
    sums = side_sums(model, tokenizer, pairs, config, cap)
    return ReplyMeans(sums[0] / len(pairs), sums[1] / len(pairs), len(pairs), config.hook, meta,
                      str(data) if fingerprint else "in memory")


def side_sums(model: Any, tokenizer: Any, pairs: Pairs, config: AttributeConfig, cap: int | None) -> torch.Tensor:
    """float64 [2, layers, width] on the CPU: over the pairs, the sum of each chosen (0) and rejected (1) reply's mean
    activation at the hook; each batch holds a bucket's chosen then rejected sequences, run once."""
    device = next(model.parameters()).device
    sums = torch.zeros(2, num_layers(model), width(model, config.hook), dtype=torch.float64, device=device)
    backend = TorchBackend(model, config.hook)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    longest = max(max(len(c), len(r)) for c, r in zip(pairs.chosen, pairs.rejected))
    size = auto_batch_size(model, config.hook, longest) if config.batch_size == "auto" else config.batch_size
    bar = tqdm(total=len(pairs), desc=f"chosen vs rejected {config.hook}", unit="pair", disable=not config.progress)
    with torch.inference_mode():
        for idx, length in pair_batches(pairs, size, cap):
            input_ids, mask = pad_right([pairs.chosen[i] for i in idx] + [pairs.rejected[i] for i in idx], pad_id,
                                        length)
            starts = torch.tensor([pairs.starts[i] for i in idx] * 2)
            reply = mask.bool() & (torch.arange(length) >= starts[:, None])
            weight = (reply / reply.sum(1, keepdim=True).clamp(min=1)).float()   # [2n, length]: each reply's mean

            def add(layer: int, t: torch.Tensor, weight: torch.Tensor = weight, n: int = len(idx)) -> None:
                means = torch.einsum("rs,rsw->rw", weight.to(t.device), t.float()).double()   # [2n, width]
                sums[:, layer] += means.view(2, n, -1).sum(1).to(device)

            backend.run(input_ids.to(device), mask.to(device), add)
            bar.update(len(idx))
    bar.close()
    return sums.cpu()
