"""Top-k activation counts per dimension: the streaming accumulator and the probe file.

Probe file (docs/ARCHITECTURE.md "Probe file"): safetensors with `count.<dim>` (int64 [layers, width]), `cases.<dim>` (int64
scalar: prompts), `observations.<dim>` (int64 scalar: counted token positions; equals cases with the
`last` token policy), `act_sum.<dim>` and `act_sq.<dim>` (int64 [2, layers, width]: the activation's sum and sum
of squares over the counted positions, as fixed-point limbs, `fixed_point`), `case_hashes` (int64 [cases], sorted:
which cases were counted, `cases.case_hash`) and each unit's top cases (`top_values`, `top_cases`:
probe/topcases.py). With resamples (metadata `resamples` R > 0), `resampled.<name>` [R, ...] for each of these but
`case_hashes` and the top cases: the Poisson bootstrap replicates (probe/resample.py). `freq = count / observations`.
Metadata records how the counts were made.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rolemrc.core.artifacts import check_format, expect, stamp
from rolemrc.probe.errors import ProbeError, ProbeFileError
from rolemrc.probe.options import Rank, Rounding, Tokens
from rolemrc.probe.resample import replicate_tensors, resample_count, stack_replicates
from rolemrc.probe.topcases import TopCases, TopCaseTracker, read_texts, texts_meta

# Metadata keys that must agree for two probe files to be comparable.
COMPARABLE_KEYS = ("hook", "width", "layers", "top_fraction", "top_rounding", "tokens", "rank", "generation_prompt",
                   "prepend_bos", "limit")
CASE_HASHES = "case_hashes"  # the probe file's tensor of case identities
FRACTION_BITS = 32
MOMENT_UNIT = 2.0 ** -FRACTION_BITS  # each observation's x and x^2 are rounded to this once, before any sum
MOMENT_MAX = 2.0 ** 14  # |activation| must stay below this (checked), so x^2, a paired case's d and d^2 fit the limbs


def fixed_point(x: torch.Tensor) -> torch.Tensor:
    """x rounded once to MOMENT_UNIT, as two limbs [2, *x.shape] (float64 holding integers, |x| < 2^31): the integer
    part floor(x) and the fraction in MOMENT_UNITs, in [0, 2^32]. Every step is exact, so the limbs are a function of x
    alone, and sums of limbs are exact in any order: in float64 below 2^21 terms, in int64 (the probe file's sums)
    below 2^31. `fixed_value` reads a (summed) pair of limbs."""
    x = x.double()
    limbs = x.new_empty(2, *x.shape)
    torch.floor(x, out=limbs[0])
    torch.sub(x, limbs[0], out=limbs[1]).mul_(2.0 ** FRACTION_BITS).round_()
    return limbs


def fixed_value(limbs: torch.Tensor) -> torch.Tensor:
    """The float64 value of fixed-point limbs [2, ...] (`fixed_point`, or sums of them)."""
    return limbs[0].double() + limbs[1].double() * MOMENT_UNIT


def dimension_sums(weights: torch.Tensor, limbs: torch.Tensor) -> torch.Tensor:
    """Per dimension, the sum of fixed-point `limbs` [2, layers, n, width] over the n observations (or cases) in it
    (`weights` [n, dims], 0/1): [2, dims, layers, width] int64. One float64 einsum, exact: limbs are integers of at
    most 2^32 (or per-case sums of them), and a batch holds fewer than 2^21 observations."""
    return torch.einsum("nd,klnw->kdlw", weights.double(), limbs).long()


def check_top_fraction(top_fraction: float) -> float:
    if not 0 < top_fraction <= 1:
        raise ProbeError(f"top_fraction must be in (0, 1], got {top_fraction}")
    return top_fraction


def top_k_size(top_fraction: float, width: int, rounding: Rounding = "up") -> int:
    """Units counted as active per observation: top_fraction * width rounded up (or down), at least 1."""
    share = check_top_fraction(top_fraction) * width
    return max(1, math.ceil(share - 1e-9) if rounding == "up" else math.floor(share + 1e-9))


def read_tensors(path: str | os.PathLike, what: str, *, missing: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a rolemrc safetensors file (probe or diff); errors name the file."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ProbeFileError(f"{path}: {missing}")
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = dict(fh.metadata() or {})
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise ProbeError(f"{path}: not a readable safetensors {what} ({exc})") from None
    if "dimensions" not in meta or "hook" not in meta:
        raise ProbeError(f"{path}: not a rolemrc {what} (metadata lacks 'dimensions'/'hook')")
    return meta, tensors


def read_probe_tensors(path: str | os.PathLike) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a probe file of counts; another kind of rolemrc file (`kind` in its metadata, as an
    attribution file has) is refused by name."""
    expect(path, ("probe", "paired-probe"), "expected a probe file (from `rolemrc probe collect`)")
    meta, tensors = read_tensors(path, "probe file", missing="no such probe file")
    check_format(path, meta, meta["kind"])
    return meta, tensors


def write_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Path:
    """Write a safetensors file atomically (a temporary file, then a rename)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return path


class TopKCounter:
    """Accumulates, per dimension, how often each unit of each layer is in the top k.

    Feed it one batch at a time: `start_batch(membership, attention_mask)`, `add(layer, acts)` for each
    layer's activations [batch, seq, width], then `finish_batch()`. At the same positions it sums each unit's
    activation x and x^2 per dimension (`moments`: [2 (x, x^2), 2 limbs, dims, layers, width] int64). Everything
    stays on the model's device; memory is O(dimensions x layers x width) plus one batch. With `keep_cases`,
    `case_share()` and `case_sums()` give the last batch's per-case activity and activation sums (for paired
    probing, probe/paired.py). With `top_cases` N > 0, `top` keeps each unit's N most activating cases
    (probe/topcases.py). With `resamples` R, every sum has (1 + R) x dimensions rows, fed a membership whose blocks of
    dimensions are the full sample's, then each replicate's weighted one (`resample.with_replicates`).
    """

    def __init__(self, dimensions: list[str], layers: int, width: int, k: int, *, tokens: Tokens = "last",
                 rank: Rank = "signed", device: torch.device | str = "cpu", keep_cases: bool = False, top_cases: int = 0,
                 resamples: int = 0):
        self.dimensions, self.layers, self.width, self.k = list(dimensions), layers, width, k
        self.top = TopCaseTracker(layers, width, top_cases, device) if top_cases else None
        self._positions: torch.Tensor | None = None  # [batch]: the batch's cases' positions (topcases.sorted_positions)
        self.tokens, self.rank, self.keep_cases = tokens, rank, keep_cases
        d = len(self.dimensions) * (1 + resamples)  # the full sample's dimensions, then each replicate's
        self.count = torch.zeros(d, layers, width, dtype=torch.int64, device=device)
        self.cases = torch.zeros(d, dtype=torch.int64, device=device)
        self.observations = torch.zeros(d, dtype=torch.int64, device=device)
        self.moments = torch.zeros(2, 2, d, layers, width, dtype=torch.int64, device=device)  # sums of x, of x^2
        self.largest = torch.zeros((), dtype=torch.float64, device=device)  # the largest floor(x^2) seen
        self._rows: torch.Tensor | None = None
        self._cols: torch.Tensor | None = None
        self._weights: torch.Tensor | None = None  # [observations, dims] 0/1
        self._membership: torch.Tensor | None = None  # [batch, dims] 0/1
        self._case_hits: torch.Tensor | None = None  # [layers, batch, width]: counted positions where a unit is active
        self._case_tokens: torch.Tensor | None = None  # [batch]: counted positions per case
        self._case_sums: torch.Tensor | None = None  # [2, layers, batch, width] float64: limbs of the sum of x per case

    @property
    def totals(self) -> list[torch.Tensor]:
        """The accumulated sums over cases (what processes counting shards of the cases add up)."""
        return [self.count, self.cases, self.observations, self.moments]

    def start_batch(self, membership: torch.Tensor, attention_mask: torch.Tensor,
                    positions: torch.Tensor | None = None) -> None:
        """membership: [batch, dims] 0/1 (which dimensions each case counts in); mask: [batch, seq]; positions: each
        case's position among the sorted case hashes (needed with `top_cases`).
        Positions are found where the mask lives (the CPU, for the collector), so no device sync."""
        device = self.count.device
        if self.top is not None:
            if positions is None:
                raise ProbeError("a TopKCounter with top_cases needs each batch's case positions")
            self._positions = positions.to(device)
        membership = membership.to(dtype=torch.float32)
        mask = attention_mask.bool()
        if self.tokens == "last":
            positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
            last = torch.where(mask, positions, -1).amax(dim=1)  # real last token, left or right padded
            if (last < 0).any():
                raise ProbeError("a case has no tokens")
            rows, cols, weights = torch.arange(mask.shape[0], device=mask.device), last, membership
        else:
            rows, cols = mask.nonzero(as_tuple=True)
            weights = membership[rows.to(membership.device)]
        self._rows, self._cols = rows.to(device), cols.to(device)
        self._weights = weights.to(device)
        self._membership = membership.to(device)
        self.cases += membership.sum(0).round().long().to(device)
        self.observations += self._weights.sum(0).round().long()
        self._pending: dict[int, torch.Tensor] = {}
        if self.keep_cases:
            batch = mask.shape[0]
            self._case_hits = torch.zeros(self.layers, batch, self.width, device=device)
            self._case_sums = torch.zeros(2, self.layers, batch, self.width, dtype=torch.float64, device=device)
            per_case = mask.sum(1) if self.tokens == "all" else torch.ones(batch, device=mask.device)
            self._case_tokens = per_case.to(device=device, dtype=torch.float64)

    def add(self, layer: int, acts: torch.Tensor) -> None:
        """Take one layer's activations [batch, seq, width] at the chosen positions. With the `last` policy
        the layers of a batch are counted together in `finish_batch` (one top-k over all layers: few kernel
        launches); with `all` (many positions) each layer is counted at once to bound memory."""
        selected = acts[self._rows.to(acts.device), self._cols.to(acts.device)].to(self.count.device)
        if selected.shape[-1] != self.width:
            raise ValueError(f"layer {layer}: expected width {self.width}, got {selected.shape[-1]}")
        if self.tokens == "last":
            self._pending[layer] = selected
        else:
            self._count([layer], selected.unsqueeze(0))

    def finish_batch(self) -> None:
        """Count the layers taken since `start_batch`."""
        if self._pending:
            layers = sorted(self._pending)
            self._count(layers, torch.stack([self._pending[i] for i in layers]))
            self._pending = {}

    def _count(self, layers: list[int], selected: torch.Tensor) -> None:
        """selected: [layers, obs, width] -> count[:, layers] += per-dimension top-k hits, and the moments."""
        scores = selected.float()
        if self.rank == "abs":
            scores = scores.abs()
        top = scores.topk(self.k, dim=-1, sorted=False).indices
        active = torch.zeros_like(scores).scatter_(-1, top, 1.0)
        # [obs, dims] x [layers, obs, width]: exact integer sums in float32 for any realistic batch
        hits = torch.einsum("od,low->dlw", self._weights, active).round().long()
        index = slice(layers[0], layers[-1] + 1) if layers == list(range(layers[0], layers[-1] + 1)) else layers
        self.count[:, index] += hits
        if self.top is not None:  # per case: its value (the largest over its positions with `all`)
            per_case = scores if self.tokens == "last" else scores.new_full(
                (len(layers), len(self._membership), self.width), -torch.inf).scatter_reduce_(
                1, self._rows[None, :, None].expand_as(scores), scores, "amax")
            self.top.add(index, per_case, self._positions)
        if self.keep_cases:  # observation -> its case (the identity with the `last` policy)
            self._case_hits[layers] = active.new_zeros(len(layers), *self._case_hits.shape[1:]).index_add_(1, self._rows, active)
        self._add_moments(index, selected)

    def _add_moments(self, index: slice | list[int], selected: torch.Tensor) -> None:
        """moments[..., index, :] += per dimension the sums over the observations of x and x^2 (each rounded once to
        MOMENT_UNIT), summed per case first (with `last`, observation i is case i); with `keep_cases`, each case's sum
        of x is kept for the batch."""
        x = selected.double()
        for s, values in enumerate((x, x * x)):
            limbs = fixed_point(values)   # [2, layers, obs, width]
            if s == 1:
                self.largest = torch.maximum(self.largest, limbs[0].amax())
            if self.tokens == "all":
                limbs = limbs.new_zeros(2, len(x), len(self._membership), self.width).index_add_(2, self._rows, limbs)
            self.moments[s][:, :, index] += dimension_sums(self._membership, limbs)
            if self.keep_cases and s == 0:
                self._case_sums[:, index] = limbs

    def check_moments(self) -> None:
        """Refuse moments of activations at or beyond MOMENT_MAX, which the fixed-point limbs cannot hold."""
        if float(self.largest) >= MOMENT_MAX ** 2:
            raise ProbeError(f"an activation of magnitude {float(self.largest) ** 0.5:.4g} at this hook point: activation "
                             f"moments hold |x| < {MOMENT_MAX:g}; probe another hook point")

    def case_share(self) -> torch.Tensor:
        """[layers, batch, width] float64: per case of the last batch, the share of its counted positions
        on which each unit was active (0/1 with the `last` policy). Needs `keep_cases`."""
        if self._case_hits is None:
            raise ProbeError("case_share() needs a TopKCounter made with keep_cases=True, after a batch")
        return self._case_hits.double() / self._case_tokens[None, :, None]

    def case_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of x per case as fixed-point limbs [2, layers, batch, width] float64, counted positions per case
        [batch] float64) of the last batch. Needs `keep_cases`."""
        if self._case_sums is None:
            raise ProbeError("case_sums() needs a TopKCounter made with keep_cases=True, after a batch")
        return self._case_sums, self._case_tokens


@dataclass
class ProbeCounts:
    """Counts and activation moments for every dimension plus the metadata that makes them comparable."""

    count: dict[str, torch.Tensor]
    cases: dict[str, int]
    observations: dict[str, int]
    case_hashes: torch.Tensor  # int64 [cases], sorted
    act_sum: dict[str, torch.Tensor]  # int64 [2, layers, width] limbs
    act_sq: dict[str, torch.Tensor]   # sums of x^2, likewise
    meta: dict[str, str] = field(default_factory=dict)
    top: TopCases | None = None  # each unit's most activating cases (collected with top_cases > 0)
    resamples: list[ProbeCounts] = field(default_factory=list)  # the Poisson bootstrap replicates (probe/resample.py)

    @property
    def dimensions(self) -> list[str]:
        return list(self.count)

    @property
    def empty_dimensions(self) -> list[str]:
        """Dimensions with no observations: they have no frequency, only the fact of being empty."""
        return [d for d in self.count if self.observations[d] == 0]

    def freq(self, dimension: str) -> torch.Tensor:
        """count / observations for one dimension; raises for an empty dimension (never divides by 0)."""
        return self.count[dimension].double() / self._observed(dimension)

    def moments(self, dimension: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, sample variance) of each unit's activation over the dimension's observations, float64. A variance
        within the fixed point's resolution, MOMENT_UNIT * (1/2 + |mean|) * n / (n - 1), is 0 (a constant unit);
        with one observation the variance is 0."""
        n = self._observed(dimension)
        total, squares = fixed_value(self.act_sum[dimension]), fixed_value(self.act_sq[dimension])
        mean = total / n
        if n < 2:
            return mean, torch.zeros_like(mean)
        var = ((squares - total * mean) / (n - 1)).clamp_min(0)
        resolution = MOMENT_UNIT * (0.5 + mean.abs()) * n / (n - 1)
        return mean, torch.where(var <= resolution, torch.zeros_like(var), var)

    def _observed(self, dimension: str) -> int:
        """The dimension's observations; raises for an unknown or empty dimension (never divides by 0)."""
        if dimension not in self.count:
            raise KeyError(f"no dimension {dimension!r}; have {self.dimensions}")
        n = self.observations[dimension]
        if n == 0:
            raise ProbeError(f"dimension {dimension!r} has no cases: its frequency and moments are undefined")
        return n

    def tensors(self, model: int | None = None) -> dict[str, torch.Tensor]:
        """The probe file's tensors; `model` adds its index to the per-model names (`count.<m>.<dim>` in a paired file)."""
        tag = "" if model is None else f"{model}."
        tensors = {}
        for d in self.dimensions:
            tensors[f"count.{tag}{d}"] = self.count[d].cpu().contiguous()
            tensors[f"cases.{d}"] = torch.tensor(self.cases[d], dtype=torch.int64)
            tensors[f"observations.{d}"] = torch.tensor(self.observations[d], dtype=torch.int64)
            tensors[f"act_sum.{tag}{d}"] = self.act_sum[d].cpu().contiguous()
            tensors[f"act_sq.{tag}{d}"] = self.act_sq[d].cpu().contiguous()
        tensors[CASE_HASHES] = self.case_hashes
        tensors |= stack_replicates([rep.tensors(model) for rep in self.resamples])
        return tensors | (self.top.tensors(f".{model}" if tag else "") if self.top is not None else {})

    def save(self, path: str | os.PathLike) -> Path:
        return write_tensors(path, self.tensors(), {**self.meta, "dimensions": json.dumps(self.dimensions),
                                                    **texts_meta([self.top]), **stamp("probe")})

    @classmethod
    def load(cls, path: str | os.PathLike) -> ProbeCounts:
        meta, tensors = read_probe_tensors(path)
        if "models" in meta:
            raise ProbeError(f"{path}: a paired probe file of {len(json.loads(meta['models']))} models, not one "
                             "model's counts (diff it alone: `rolemrc probe diff PAIRED --a 0 --b 1 --out DIR`)")
        return cls.from_tensors(meta, tensors)

    @classmethod
    def from_tensors(cls, meta: dict[str, str], tensors: dict[str, torch.Tensor], model: int | None = None) -> ProbeCounts:
        """From a probe file's metadata and tensors; `model` picks one model's counts in a paired file (whose
        replicates the PairedCounts holds)."""
        tag = "" if model is None else f"{model}."
        resamples = [] if model is not None else [cls.from_tensors(meta, replicate_tensors(tensors, r))
                                                  for r in range(resample_count(tensors))]
        meta = dict(meta)
        dims = json.loads(meta.pop("dimensions"))
        top = TopCases.from_tensors(tensors, read_texts(meta), "" if model is None else f".{model}")
        count = {d: tensors[f"count.{tag}{d}"] for d in dims}
        cases = {d: int(tensors[f"cases.{d}"]) for d in dims}
        observations = {d: int(tensors[f"observations.{d}"]) for d in dims}
        moments = [{d: tensors[f"{name}.{tag}{d}"] for d in dims} for name in ("act_sum", "act_sq")]
        return cls(count, cases, observations, tensors[CASE_HASHES], *moments, meta=meta, top=top, resamples=resamples)
