"""Top-k activation counts per dimension: the streaming accumulator and the probe file.

Probe file (DESIGN.md): safetensors with `count.<dim>` (int64 [layers, width]), `cases.<dim>` (int64
scalar: prompts) and `observations.<dim>` (int64 scalar: counted token positions; equals cases with the
`last` token policy). `freq = count / observations`. Metadata records how the counts were made.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Metadata keys that must agree for two probe files to be comparable.
COMPARABLE_KEYS = ("hook", "width", "layers", "top_fraction", "tokens")


def top_k_size(top_fraction: float, width: int) -> int:
    """Units counted as active per observation: ceil(top_fraction * width), at least 1."""
    if not 0 < top_fraction <= 1:
        raise ValueError(f"top_fraction must be in (0, 1], got {top_fraction}")
    return max(1, math.ceil(top_fraction * width - 1e-9))


class TopKCounter:
    """Accumulates, per dimension, how often each unit of each layer is in the top k.

    Feed it one batch at a time: `start_batch(membership, attention_mask)`, then `add(layer, acts)` for each
    layer's activations [batch, seq, width]. Everything stays on the activations' device; memory is
    O(dimensions x layers x width) plus one batch.
    """

    def __init__(self, dimensions: list[str], layers: int, width: int, k: int, *, tokens: str = "last",
                 rank: str = "signed", device: torch.device | str = "cpu"):
        if tokens not in ("last", "all"):
            raise ValueError(f"tokens must be 'last' or 'all', got {tokens!r}")
        if rank not in ("signed", "abs"):
            raise ValueError(f"rank must be 'signed' or 'abs', got {rank!r}")
        self.dimensions, self.layers, self.width, self.k = list(dimensions), layers, width, k
        self.tokens, self.rank = tokens, rank
        d = len(self.dimensions)
        self.count = torch.zeros(d, layers, width, dtype=torch.int64, device=device)
        self.cases = torch.zeros(d, dtype=torch.int64, device=device)
        self.observations = torch.zeros(d, dtype=torch.int64, device=device)
        self._rows: torch.Tensor | None = None
        self._cols: torch.Tensor | None = None
        self._weights: torch.Tensor | None = None

    def start_batch(self, membership: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """membership: [batch, dims] 0/1 (which dimensions each case counts in); mask: [batch, seq]."""
        device = self.count.device
        membership = membership.to(device=device, dtype=torch.float32)
        mask = attention_mask.to(device).bool()
        if self.tokens == "last":
            positions = torch.arange(mask.shape[1], device=device).expand_as(mask)
            last = torch.where(mask, positions, -1).amax(dim=1)  # real last token, left or right padded
            if (last < 0).any():
                raise ValueError("a case has no tokens")
            self._rows, self._cols = torch.arange(mask.shape[0], device=device), last
            self._weights = membership
        else:
            self._rows, self._cols = mask.nonzero(as_tuple=True)
            self._weights = membership[self._rows]
        self.cases += membership.sum(0).round().long()
        self.observations += self._weights.sum(0).round().long()

    def add(self, layer: int, acts: torch.Tensor) -> None:
        """Count the top-k units of one layer's activations [batch, seq, width] at the chosen positions."""
        selected = acts[self._rows.to(acts.device), self._cols.to(acts.device)].to(self.count.device)
        if selected.shape[-1] != self.width:
            raise ValueError(f"layer {layer}: expected width {self.width}, got {selected.shape[-1]}")
        scores = selected.float()
        if self.rank == "abs":
            scores = scores.abs()
        top = scores.topk(self.k, dim=-1, sorted=False).indices
        active = torch.zeros_like(scores).scatter_(1, top, 1.0)
        # [dims, obs] @ [obs, width]: exact integer sums in float32 for any realistic batch
        self.count[:, layer] += (self._weights.T @ active).round().long()


@dataclass
class ProbeCounts:
    """Counts for every dimension plus the metadata that makes them comparable."""

    count: dict[str, torch.Tensor]
    cases: dict[str, int]
    observations: dict[str, int]
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def dimensions(self) -> list[str]:
        return list(self.count)

    @property
    def empty_dimensions(self) -> list[str]:
        """Dimensions with no observations: they have no frequency, only the fact of being empty."""
        return [d for d in self.count if self.observations[d] == 0]

    def freq(self, dimension: str) -> torch.Tensor:
        """count / observations for one dimension; raises for an empty dimension (never divides by 0)."""
        if dimension not in self.count:
            raise KeyError(f"no dimension {dimension!r}; have {self.dimensions}")
        n = self.observations[dimension]
        if n == 0:
            raise ValueError(f"dimension {dimension!r} has no cases: its frequency is undefined")
        return self.count[dimension].double() / n

    def save(self, path: str | os.PathLike) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for d in self.dimensions:
            tensors[f"count.{d}"] = self.count[d].cpu().contiguous()
            tensors[f"cases.{d}"] = torch.tensor(self.cases[d], dtype=torch.int64)
            tensors[f"observations.{d}"] = torch.tensor(self.observations[d], dtype=torch.int64)
        meta = {**self.meta, "dimensions": json.dumps(self.dimensions)}
        tmp = path.with_suffix(path.suffix + ".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> ProbeCounts:
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such probe file")
        try:
            with safe_open(str(path), framework="pt") as fh:
                meta = dict(fh.metadata() or {})
                tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ValueError(f"{path}: not a readable safetensors probe file ({exc})") from None
        if "dimensions" not in meta or "hook" not in meta:
            raise ValueError(f"{path}: not a rolemrc probe file (metadata lacks 'dimensions'/'hook')")
        dims = json.loads(meta.pop("dimensions"))
        count = {d: tensors[f"count.{d}"] for d in dims}
        cases = {d: int(tensors[f"cases.{d}"]) for d in dims}
        observations = {d: int(tensors.get(f"observations.{d}", tensors[f"cases.{d}"])) for d in dims}
        return cls(count, cases, observations, meta)
