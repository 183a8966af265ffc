"""Per unit, the cases that activate it most: while `probe collect` streams, each unit keeps its top N cases by the
unit's activation at the counted token(s) (the last prompt token; with tokens=all the case's largest over its prompt
tokens; |activation| with rank=abs).

Each (value, case) is one int64 key, value bits high and the case's position (in the file's sorted `case_hashes`)
low, so one `topk` over (running top N ++ batch) per batch merges, on the model's device, and ties break by case
position: the same lists from one pass, from shards merged (`probe merge`) or from ranks gathered. A file stores
`top_values` (`top_values.<m>` per model of a paired file; float32 [layers, width, N], descending, NaN where fewer
than N cases), `top_cases` (int32, positions in `case_hashes`, -1 where empty) and, in its metadata,
`top_case_texts`: each listed case's id, dimensions and prompt (its last turn, cut to TEXT_CHARS).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from rolemrc.probe.errors import ProbeError

TEXT_CHARS = 200  # a case's prompt as stored: its last turn, cut to this many characters
EMPTY = torch.iinfo(torch.int64).min  # a slot that holds no case (a unit seen on fewer than N cases)
LOW = 2 ** 32 - 1  # the low 32 bits: LOW - position, so at equal values the lower position ranks first
TEXTS_KEY = "top_case_texts"  # the metadata key of the listed cases' texts
TOP_FILE = "top_cases.safetensors"  # in a diff folder: both sides' top cases (`save_sides`)


def check_top_cases(n: int) -> int:
    if n < 0:
        raise ProbeError(f"top cases must be >= 0 (0: off), got {n}")
    return n


def pack(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 keys ordering as (value descending, then position ascending); `positions` broadcast against the float32
    `values`; EMPTY where a position is negative."""
    bits = values.float().contiguous().view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # an int32 that orders as the floats do
    positions = positions.long()
    keys = (ordered.long() << 32) | (LOW - positions.clamp_min(0))
    return torch.where(positions >= 0, keys, EMPTY)


def unpack(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values float32, NaN where empty; positions int32, -1 where empty) of packed keys."""
    ordered = (keys >> 32).int()
    values = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).view(torch.float32)
    empty = keys == EMPTY
    positions = (LOW - (keys & LOW)).int()
    return values.masked_fill(empty, torch.nan), positions.masked_fill(empty, -1)


def keep_top(keys: torch.Tensor, n: int) -> torch.Tensor:
    """The n largest packed keys along the last dimension, descending."""
    return keys.topk(n, dim=-1).values


def sorted_positions(hashes: torch.Tensor) -> torch.Tensor:
    """Each case's position in its hashes sorted (stably), as a probe file stores `case_hashes`."""
    order = torch.sort(hashes, stable=True).indices
    positions = torch.empty_like(order)
    positions[order] = torch.arange(len(order))
    return positions


def case_text(turns: list[dict[str, str]]) -> str:
    """A case's prompt as the top lists show it: its last turn, cut to TEXT_CHARS characters."""
    text = turns[-1]["content"] if turns else ""
    return text if len(text) <= TEXT_CHARS else text[:TEXT_CHARS - 1] + "…"


class TopCaseTracker:
    """The running top N cases per unit of one model, as packed keys [layers, width, N] on the model's device."""

    def __init__(self, layers: int, width: int, n: int, device: torch.device | str):
        self.n = n
        self.keys = torch.full((layers, width, n), EMPTY, dtype=torch.int64, device=device)

    def add(self, index: slice | list[int], per_case: torch.Tensor, positions: torch.Tensor) -> None:
        """Merge a batch: per_case [layers of `index`, batch, width] (each case's value), positions [batch]."""
        batch = pack(per_case.transpose(1, 2), positions)
        self.keys[index] = keep_top(torch.cat([self.keys[index], batch], dim=-1), self.n)

    def merge_ranks(self, parts: list[torch.Tensor]) -> None:
        """Merge the trackers' keys of every process (this one's among `parts`)."""
        self.keys = keep_top(torch.cat(parts, dim=-1), self.n)


@dataclass
class TopCases:
    """One model's top cases per unit (module docstring); `texts` maps each listed position to its case's id,
    dimensions and text."""

    values: torch.Tensor  # float32 [layers, width, N]
    cases: torch.Tensor   # int32 [layers, width, N]
    texts: dict[int, dict[str, Any]]

    @property
    def n(self) -> int:
        return self.values.shape[-1]

    @classmethod
    def from_keys(cls, keys: torch.Tensor, describe: dict[int, dict[str, Any]]) -> TopCases:
        """From packed keys, with the texts of the listed positions taken from `describe` (position -> text)."""
        return cls.listing(*unpack(keys.cpu()), describe)

    @classmethod
    def listing(cls, values: torch.Tensor, cases: torch.Tensor, texts: dict[int, dict[str, Any]]) -> TopCases:
        """The top cases with the texts of the positions they list (`texts` may hold more)."""
        return cls(values, cases, {p: texts[p] for p in torch.unique(cases[cases >= 0]).tolist()})

    def keys(self, new_positions: torch.Tensor | None = None) -> torch.Tensor:
        """The packed keys; with `new_positions` (old position -> new), the cases renumbered."""
        cases = self.cases.long()
        if new_positions is not None:
            cases = torch.where(cases >= 0, new_positions[cases.clamp_min(0)], -1)
        return pack(self.values, cases)

    def tensors(self, suffix: str = "") -> dict[str, torch.Tensor]:
        """The file's tensors; `suffix` (".<m>" in a paired file) names the model."""
        return {f"top_values{suffix}": self.values.contiguous(), f"top_cases{suffix}": self.cases.contiguous()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], texts: dict[int, dict[str, Any]],
                     suffix: str = "") -> TopCases | None:
        """The top cases stored with `suffix` (None when the file has none)."""
        if f"top_values{suffix}" not in tensors:
            return None
        return cls.listing(tensors[f"top_values{suffix}"], tensors[f"top_cases{suffix}"], texts)


def texts_meta(tops: list[TopCases | None], key: str = TEXTS_KEY) -> dict[str, str]:
    """The metadata entry `key` holding the listed cases' texts of one file (its models' top cases share positions)."""
    texts = {p: t for top in tops if top is not None for p, t in top.texts.items()}
    return {key: json.dumps({str(p): texts[p] for p in sorted(texts)})} if texts else {}


def read_texts(meta: dict[str, str], key: str = TEXTS_KEY) -> dict[int, dict[str, Any]]:
    """The listed cases' texts of a file's metadata (popped from it)."""
    return {int(p): t for p, t in json.loads(meta.pop(key, "{}")).items()}


def save_sides(path: str | os.PathLike, tops: dict[str, TopCases]) -> None:
    """Write a diff's top cases, per side ("a", "b"), into one safetensors file (TOP_FILE in the diff folder)."""
    from safetensors.torch import save_file

    tensors = {name: t for side, top in tops.items() for name, t in top.tensors(f".{side}").items()}
    meta = {"sides": json.dumps(list(tops))}
    for side, top in tops.items():
        meta.update(texts_meta([top], f"{TEXTS_KEY}.{side}"))
    save_file(tensors, str(path), metadata=meta)


def load_sides(path: str | os.PathLike) -> dict[str, TopCases]:
    """A diff's top cases per side (`save_sides`); {} when the file is absent."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        return {}
    with safe_open(str(path), framework="pt") as fh:
        meta = dict(fh.metadata() or {})
        tensors = {name: fh.get_tensor(name) for name in fh.keys()}  # noqa: SIM118 (safe_open is not a dict)
    return {side: TopCases.from_tensors(tensors, read_texts(meta, f"{TEXTS_KEY}.{side}"), f".{side}")
            for side in json.loads(meta["sides"])}


def renumbered(hashes: torch.Tensor, merged: torch.Tensor) -> torch.Tensor:
    """Old position -> position in `merged` (sorted hashes holding all of `hashes`, sorted), repeated hashes kept
    apart in their order."""
    first = torch.searchsorted(hashes, hashes)
    return torch.searchsorted(merged, hashes) + (torch.arange(len(hashes)) - first)


def merge_top(parts: list[tuple[TopCases, torch.Tensor]], merged: torch.Tensor) -> TopCases:
    """One model's top cases of files over disjoint cases, (top cases, the file's sorted case hashes) each, renumbered
    into the merged sorted hashes: equal to one pass over all the cases."""
    keys, texts = [], {}
    for top, hashes in parts:
        new = renumbered(hashes, merged)
        keys.append(top.keys(new))
        texts.update({int(new[p]): t for p, t in top.texts.items()})
    return TopCases.from_keys(keep_top(torch.cat(keys, dim=-1), parts[0][0].n), texts)
