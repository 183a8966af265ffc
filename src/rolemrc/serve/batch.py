"""A left-padded decoding batch over one KV cache: prefill, one-token steps, dropping rows, merging batches; each row
keeps its own restraint (`intervene.runtime.RowScales`), so rows under different restraints share every forward."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rolemrc.intervene.runtime import RowScales, applied_rows


class Batch:
    """Rows share one DynamicCache; padding sits on the left and is masked out. Positions are kept per
    row, so rows of different prompt lengths (and batches merged mid-generation) decode correctly. `scales` holds
    each row's restraint multipliers and follows the rows through `select` and `merge`."""

    def __init__(self, cache: DynamicCache, mask: torch.Tensor, next_pos: torch.Tensor, scales: RowScales) -> None:
        self.cache, self.mask, self.next_pos, self.scales = cache, mask, next_pos, scales

    def __len__(self) -> int:
        return self.mask.shape[0]

    @classmethod
    def prefill(cls, model: Any, prompts: list[list[int]], pad_id: int, scales: RowScales,
                every_position: bool = False) -> tuple[Batch, torch.Tensor]:
        """Run the prompts, row i under row i of `scales`; returns the batch and the last-position logits [B, V]
        (every position's, [B, T, V] left-padded, if asked)."""
        device = model.device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache(config=model.config)
        with applied_rows(model, scales):
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                        use_cache=True, logits_to_keep=0 if every_position else 1)
        return cls(out.past_key_values, mask, mask.sum(-1), scales), out.logits if every_position else out.logits[:, -1]

    def step(self, model: Any, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row; returns next logits [B, V]."""
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self), 1))], dim=1)
        with applied_rows(model, self.scales):
            out = model(input_ids=tokens[:, None].to(self.mask.device), attention_mask=self.mask,
                        position_ids=self.next_pos[:, None], past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1]

    def select(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order); columns that became padding everywhere are trimmed."""
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self.next_pos = self.next_pos[index]
        self.scales = self.scales.select(rows)
        if len(rows):
            lead = int((self.mask.sum(0) == 0).long().cumprod(0).sum())   # all-padding columns on the left
            if lead:
                self.mask = self.mask[:, lead:]
                for layer in self.cache.layers:
                    layer.keys, layer.values = layer.keys[..., lead:, :], layer.values[..., lead:, :]

    def can_merge(self) -> bool:
        return all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def merge(self, other: Batch) -> None:
        """Append `other`'s rows, left-padding whichever cache is shorter."""
        width = max(self.mask.shape[1], other.mask.shape[1])

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            if not missing:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([pad(mine.keys, 2), pad(theirs.keys, 2)], dim=0)
            mine.values = torch.cat([pad(mine.values, 2), pad(theirs.values, 2)], dim=0)
        self.mask = torch.cat([pad(self.mask, 1), pad(other.mask, 1)], dim=0)
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.scales = self.scales.merge(other.scales)
