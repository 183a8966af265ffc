"""Paired probing: several models over the same cases, and per pair of models the per-unit paired statistics.

Paired probe file (docs/ARCHITECTURE.md "Probe file"): `count.<m>.<dim>` per model m, `cases.<dim>` and
`observations.<dim>` (shared), and per pair of models
- tokens=last: `discordant.<i>.<j>.<dim>` (int64 [layers, width], every i != j): cases on which the unit
  is active under model i and not under model j (McNemar's off-diagonal cells);
- tokens=all: `share_diff_sum.<i>.<j>.<dim>` and `share_diff_sq.<i>.<j>.<dim>` (int64 fixed point, units of
  SHARE_UNIT, i < j): the sum over cases of d and of d^2, d = share_j - share_i, a case's share being the
  fraction of its prompt tokens on which the unit is active (a paired t-test per unit, streamed). Each case's
  d and d^2 are rounded to SHARE_UNIT before they are summed, so the sums are exact in any order: shards
  counted in several processes, or probe files merged, give the same tensors as one pass.
Per model `act_sum.<m>.<dim>`, `act_sq.<m>.<dim>` (its activation moments, as in a single file), and per pair (i < j,
both token policies) `act_diff_sum.<i>.<j>.<dim>`, `act_diff_sq.<i>.<j>.<dim>` (int64 [2, layers, width], fixed-point
limbs as `counts.fixed_point`): the sums over cases of d and d^2, d = the case's mean over its counted positions of
x_j - x_i (each case's d and d^2 rounded once to MOMENT_UNIT), for a paired t-test of each unit's activation.
Per model `top_values.<m>` and `top_cases.<m>` (each unit's most activating cases, probe/topcases.py; their texts
shared). With resamples, `resampled.<name>` [R, ...] for each of these but the top cases (probe/resample.py).
Metadata: the shared counting keys, `dimensions`, and `models` (JSON list, per model: model,
model_fingerprint, dtype, attn_implementation).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rolemrc.core.artifacts import stamp
from rolemrc.probe.counts import (
    ProbeCounts,
    TopKCounter,
    dimension_sums,
    fixed_point,
    fixed_value,
    read_probe_tensors,
    write_tensors,
)
from rolemrc.probe.errors import ProbeError
from rolemrc.probe.resample import replicate_tensors, resample_count, stack_replicates
from rolemrc.probe.topcases import read_texts, texts_meta

NAME_KEYS = ("model", "model_dir")  # how a model was named and where it was found: not what it is
MODEL_KEYS = (*NAME_KEYS, "model_fingerprint", "model_fingerprint_of", "dtype", "attn_implementation")  # per model
STATS = {"last": ("discordant",), "all": ("share_diff_sum", "share_diff_sq")}
ACT_DIFF = ("act_diff_sum", "act_diff_sq")  # per pair, both token policies
PAIR_STATS = (*STATS["last"], *STATS["all"], *ACT_DIFF)  # every per-pair tensor's name
SHARE_BITS = 36
SHARE_UNIT = 2.0 ** -SHARE_BITS  # per-case rounding of d and d^2; sums stay exact below 2^27 cases
MAX_BATCH = 2 ** (53 - SHARE_BITS)  # a batch's float64 sum of SHARE_UNIT multiples in [-1, 1] is exact below this


class PairedCounter:
    """TopKCounters of several models fed the same batches, plus per pair (i < j) of models the per-unit
    paired statistics of their per-case activity, accumulated with tensor ops on the counters' device.

    `stats[p]` is [2, dims, layers, width] int64 for pair p: with tokens=last, cases active under i and not j,
    then under j and not i; with tokens=all, the sums of d and d^2 (d = share_j - share_i per case) in SHARE_UNITs.
    `act_diff[p]` [2, 2 limbs, dims, layers, width] holds the sums of d and d^2 for d = the case's mean activation
    under j minus under i, in fixed point. State is O(models^2 x dims x layers x width): it never grows with the number of cases.
    """

    def __init__(self, counters: list[TopKCounter]):
        if len(counters) < 2 or not all(c.keep_cases for c in counters):
            raise ProbeError("paired counting needs two or more TopKCounters made with keep_cases=True")
        first = counters[0]
        self.counters, self.tokens = counters, first.tokens
        self.pairs = list(itertools.combinations(range(len(counters)), 2))
        shape = (len(self.pairs), 2, len(first.count), first.layers, first.width)  # rows: dimensions x (1 + resamples)
        self.stats = torch.zeros(shape, dtype=torch.int64, device=first.count.device)
        self.act_diff = torch.zeros(len(self.pairs), 2, *shape[1:], dtype=torch.int64, device=first.count.device)

    @property
    def totals(self) -> list[torch.Tensor]:
        """Every counter's sums and the pairs' statistics: all sums over cases."""
        return [t for counter in self.counters for t in counter.totals] + [self.stats, self.act_diff]

    def add_batch(self, membership: torch.Tensor) -> None:
        """After every model's counter saw the batch: accumulate the pairs' statistics per dimension.
        membership: [batch, dims] 0/1, as given to the counters."""
        weights = membership.to(device=self.stats.device, dtype=torch.float64)
        if len(weights) >= MAX_BATCH:
            raise ProbeError(f"paired probing takes batches of fewer than {MAX_BATCH} cases, got {len(weights)}")
        for p, (i, j) in enumerate(self.pairs):
            share_i = self.counters[i].case_share().to(self.stats.device)
            share_j = self.counters[j].case_share().to(self.stats.device)
            if self.tokens == "last":  # 0/1 per case: discordant cases, both ways
                terms = (share_i * (1 - share_j), share_j * (1 - share_i))
            else:  # per case in whole SHARE_UNITs: the sums below are integers, exact in float64
                d = share_j - share_i
                terms = ((d / SHARE_UNIT).round(), (d * d / SHARE_UNIT).round())
            for s, term in enumerate(terms):
                self.stats[p, s] += torch.einsum("cd,lcw->dlw", weights, term).round().long()
            d = self._activation_diff(i, j)
            for s, values in enumerate((d, d * d)):
                self.act_diff[p, s] += dimension_sums(weights, fixed_point(values))

    def _activation_diff(self, i: int, j: int) -> torch.Tensor:
        """[layers, batch, width] float64: per case of the batch, d = its mean activation under model j minus under
        model i (from the fixed-point per-case sums: the same d in any process)."""
        sums_i, tokens = self.counters[i].case_sums()
        sums_j = self.counters[j].case_sums()[0]
        means = [fixed_value(sums.to(self.act_diff.device)) / tokens.to(self.act_diff.device)[None, :, None]
                 for sums in (sums_i, sums_j)]
        return means[1] - means[0]

    def tensors(self, dimensions: list[str], block: int = 0) -> dict[str, torch.Tensor]:
        """The paired file's per-pair tensors (module docstring) of the full sample (block 0) or of replicate
        block - 1 (`TopKCounter`'s rows)."""
        out = {}
        for p, (i, j) in enumerate(self.pairs):
            for k, d in enumerate(dimensions, start=block * len(dimensions)):
                first, second = self.stats[p, 0, k].cpu(), self.stats[p, 1, k].cpu()
                if self.tokens == "last":
                    out[f"discordant.{i}.{j}.{d}"], out[f"discordant.{j}.{i}.{d}"] = first, second
                else:
                    out[f"share_diff_sum.{i}.{j}.{d}"], out[f"share_diff_sq.{i}.{j}.{d}"] = first, second
                for s, name in enumerate(ACT_DIFF):
                    out[f"{name}.{i}.{j}.{d}"] = self.act_diff[p, s, :, k].cpu().contiguous()
        return out


@dataclass
class PairedCounts:
    """Counts of several models over the same cases (`counts[m]`, each with its model's metadata) and the
    per-pair statistics (`pair_stats`, keyed as in the file); `resamples`: its Poisson bootstrap replicates
    (probe/resample.py), each a PairedCounts."""

    counts: list[ProbeCounts]
    pair_stats: dict[str, torch.Tensor]
    meta: dict[str, str]  # shared keys (hook, tokens, ...), without the per-model ones
    resamples: list[PairedCounts] = field(default_factory=list)

    @property
    def models(self) -> list[str]:
        return [c.meta.get("model", "") for c in self.counts]

    @property
    def dimensions(self) -> list[str]:
        return self.counts[0].dimensions

    def check_index(self, *indices: int) -> None:
        for m in indices:
            if not 0 <= m < len(self.counts):
                raise ProbeError(f"no model {m} in this paired probe file: it has models 0-{len(self.counts) - 1} "
                                 f"({', '.join(self.models)})")

    def discordant(self, i: int, j: int, dimension: str) -> torch.Tensor:
        """Cases of `dimension` on which each unit is active under model i and not under model j (tokens=last)."""
        return self.pair_stats[f"discordant.{i}.{j}.{dimension}"]

    def share_diff(self, i: int, j: int, dimension: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of d, sum of d^2) over the cases of `dimension`, d = share_j - share_i (tokens=all), float64."""
        return self._diff_sums(STATS["all"], lambda t: t.double() * SHARE_UNIT, i, j, dimension)

    def act_diff(self, i: int, j: int, dimension: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of d, sum of d^2) over the cases of `dimension`, d = a case's mean activation under j minus under i
        (both token policies), float64."""
        return self._diff_sums(ACT_DIFF, fixed_value, i, j, dimension)

    def _diff_sums(self, names: tuple[str, str], value: Callable[[torch.Tensor], torch.Tensor], i: int, j: int,
                   dimension: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of d, sum of d^2), float64, read by `value` from the pair's tensors `names`; d's sign follows i -> j."""
        lo, hi = min(i, j), max(i, j)
        total, squares = (value(self.pair_stats[f"{name}.{lo}.{hi}.{dimension}"]) for name in names)
        return (total if i < j else -total), squares

    def tensors(self) -> dict[str, torch.Tensor]:
        """The paired file's tensors (module docstring)."""
        tensors = dict(self.pair_stats)
        for m, counts in enumerate(self.counts):
            tensors.update(counts.tensors(model=m))
        return tensors | stack_replicates([rep.tensors() for rep in self.resamples])

    def save(self, path: str | os.PathLike) -> Path:
        tensors = self.tensors()
        models = [{key: c.meta.get(key, "") for key in MODEL_KEYS} for c in self.counts]
        meta = {**self.meta, "dimensions": json.dumps(self.dimensions), "models": json.dumps(models),
                **texts_meta([c.top for c in self.counts]), **stamp("paired-probe")}
        return write_tensors(path, tensors, meta)

    @classmethod
    def from_tensors(cls, meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> PairedCounts:
        resamples = [cls.from_tensors(dict(meta), replicate_tensors(tensors, r)) for r in range(resample_count(tensors))]
        models = json.loads(meta.pop("models"))
        counts = [ProbeCounts.from_tensors({**meta, **model}, tensors, model=m) for m, model in enumerate(models)]
        meta.pop("dimensions")
        read_texts(meta)
        stats = {k: v for k, v in tensors.items() if k.split(".", 1)[0] in PAIR_STATS}
        return cls(counts, stats, meta, resamples)


def load_probe(path: str | os.PathLike) -> ProbeCounts | PairedCounts:
    """A probe file: one model's counts (ProbeCounts) or a paired file of several models (PairedCounts)."""
    meta, tensors = read_probe_tensors(path)
    if "models" in meta:
        return PairedCounts.from_tensors(meta, tensors)
    return ProbeCounts.from_tensors(meta, tensors)
