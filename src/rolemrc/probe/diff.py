"""`diff`: compare two probe files (a = SFT, b = DPO by convention) layer by layer and unit by unit: the top-k
frequency delta with its test, and (from the activation moments) the standardized effect with its own test."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from rolemrc.core.artifacts import check_format, describe, expect, stamp
from rolemrc.core.stats import TEST_LABELS, benjamini_hochberg, mcnemar, paired_t_test, two_proportion_test, welch_t_test
from rolemrc.probe import selectors
from rolemrc.probe.counts import COMPARABLE_KEYS, ProbeCounts, read_tensors
from rolemrc.probe.errors import ProbeError
from rolemrc.probe.paired import PairedCounts, load_probe
from rolemrc.probe.ranking import first_per_group, moved, rank_units
from rolemrc.probe.resample import RESAMPLED, replicate_tensors, resample_count, selection_overlap, stack_replicates
from rolemrc.probe.selectors import View
from rolemrc.probe.topcases import TOP_FILE, TopCases, load_sides, save_sides

DIFF_FILE = "diff.safetensors"
# The per-unit tests, by code (core.stats.TEST_LABELS; diff metadata and summary.json "test" and "effect_test"):
# frequency: "mcnemar" (paired, tokens=last), "paired-t" on per-case token shares (paired, tokens=all),
# "two-proportion-z" (unpaired, tokens=last), "none" (unpaired, tokens=all); standardized effect: "paired-t" on
# per-case mean activation differences (paired), "welch-t" from the moments (unpaired, tokens=last), "none"
# (unpaired, tokens=all).
EFFECT_TABLES = ("mean_a", "mean_b", "effect", "effect_t", "effect_p", "effect_q")  # DiffResult fields, diff tensors
RESAMPLED_TABLES = ("delta", "qvalue", "effect", "effect_q")   # what a diff keeps of each replicate: what selectors read
STABILITY_PER_LAYER = (16, 64, 256)   # units per layer `DiffResult.stability` reports by default
NO_TEST_WHY = ("unpaired tokens=all probe files count every prompt token as a trial, but the tokens of one prompt are "
               "correlated: no valid per-unit test, so no p- or q-values (collect both models paired: "
               "`rolemrc probe collect --model A --model B --tokens all`)")


class ProbeMismatchError(ProbeError):
    """Two probe files were counted differently and cannot be compared."""


@dataclass
class DiffResult:
    """Per-dimension [layers, width] tensors and the metadata of both sides."""

    freq_a: dict[str, torch.Tensor]
    freq_b: dict[str, torch.Tensor]
    delta: dict[str, torch.Tensor]
    z: dict[str, torch.Tensor]  # the test's signed statistic: z, McNemar's (b10 - b01) / sqrt(b01 + b10), or t
    pvalue: dict[str, torch.Tensor]
    qvalue: dict[str, torch.Tensor]
    meta: dict[str, str]
    cases_a: dict[str, int] = field(default_factory=dict)
    cases_b: dict[str, int] = field(default_factory=dict)
    empty: dict[str, str] = field(default_factory=dict)  # dimension -> why it was not compared
    # From the activation moments: each unit's mean activation under a and b, the standardized
    # effect (mean_b - mean_a) / sqrt((var_a + var_b) / 2) (0 where both variances are 0), and its test (NaN: none).
    mean_a: dict[str, torch.Tensor] = field(default_factory=dict)
    mean_b: dict[str, torch.Tensor] = field(default_factory=dict)
    effect: dict[str, torch.Tensor] = field(default_factory=dict)
    effect_t: dict[str, torch.Tensor] = field(default_factory=dict)
    effect_p: dict[str, torch.Tensor] = field(default_factory=dict)
    effect_q: dict[str, torch.Tensor] = field(default_factory=dict)
    top_cases: dict[str, TopCases] = field(default_factory=dict)  # side ("a", "b") -> its probe's top cases
    # The diffs of the probes' Poisson bootstrap replicates (probe/resample.py); a loaded diff's replicates hold the
    # tables the selectors read (RESAMPLED_TABLES) of the dimensions every replicate compared.
    resamples: list[DiffResult] = field(default_factory=list)

    @property
    def dimensions(self) -> list[str]:
        return list(self.delta)

    @property
    def hook(self) -> str:
        return self.meta["hook"]

    @property
    def k(self) -> int:
        return int(self.meta["k"])

    @property
    def test(self) -> str:
        """The frequency's per-unit test, by code."""
        return self.meta["test"]

    @property
    def effect_test(self) -> str:
        """The standardized effect's per-unit test, by code."""
        return self.meta["effect_test"]

    @property
    def tested(self) -> bool:
        """False where no valid per-unit test exists: statistic, p and q are NaN and never reported."""
        return self.test != "none"

    @property
    def effect_tested(self) -> bool:
        return self.effect_test != "none"

    def layer_summary(self, fdr: float = 0.05) -> list[dict]:
        """One row per dimension and layer: mean |delta|, signed mean, max |delta|, significant units
        (None without a test), Jaccard of the top-k sets under a and b."""
        rows = []
        for d in self.dimensions:
            delta = self.delta[d]
            jaccard = top_set_jaccard(self.freq_a[d], self.freq_b[d], self.k)
            significant = (self.qvalue[d] < fdr).sum(1)
            for layer in range(delta.shape[0]):
                rows.append({
                    "dimension": d, "layer": layer,
                    "mean_abs_delta": float(delta[layer].abs().mean()),
                    "signed_mean_delta": float(delta[layer].mean()),
                    "max_abs_delta": float(delta[layer].abs().max()),
                    "significant_units": int(significant[layer]) if self.tested else None,
                    "top_set_jaccard": float(jaccard[layer]),
                })
        return rows

    def ranked_units(self, top_n: int = 200) -> list[dict]:
        """The `top_n` most changed units per dimension (`ranking.rank_units` order); without a test the rows have
        no z, p or q."""
        rows = []
        for d in self.dimensions:
            delta = self.delta[d]
            width = delta.shape[1]
            for flat in rank_units(delta, self.qvalue[d])[:top_n].tolist():
                layer, unit = divmod(flat, width)
                row = {"dimension": d, "layer": layer, "unit": unit, "freq_a": float(self.freq_a[d][layer, unit]),
                       "freq_b": float(self.freq_b[d][layer, unit]), "delta": float(delta[layer, unit])}
                if self.tested:
                    row.update(z=float(self.z[d][layer, unit]), p=float(self.pvalue[d][layer, unit]),
                               q=float(self.qvalue[d][layer, unit]))
                names = EFFECT_TABLES if self.effect_tested else EFFECT_TABLES[:3]
                row.update({name: float(getattr(self, name)[d][layer, unit]) for name in names})
                rows.append(row)
        return rows

    def save(self, out_dir: str | os.PathLike, *, top_n: int = 200, fdr: float = 0.05) -> Path:
        """Write diff.safetensors, layers.json, units.csv/json, summary.json and (when the probes kept them) both
        sides' top cases (topcases.TOP_FILE) into out_dir."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for d in self.dimensions:
            for name, table, dtype in (("freq_a", self.freq_a, torch.float32), ("freq_b", self.freq_b, torch.float32),
                                       ("delta", self.delta, torch.float32), ("z", self.z, torch.float32),
                                       ("pvalue", self.pvalue, torch.float64), ("qvalue", self.qvalue, torch.float64)):
                tensors[f"{name}.{d}"] = table[d].to(dtype).contiguous()
            for name in EFFECT_TABLES:
                dtype = torch.float64 if name in ("effect_p", "effect_q") else torch.float32
                tensors[f"{name}.{d}"] = getattr(self, name)[d].to(dtype).contiguous()
        tensors |= stack_replicates([{f"{name}.{d}": getattr(rep, name)[d].to(tensors[f"{name}.{d}"].dtype)
                                      for name in RESAMPLED_TABLES for d in self.resampled_dimensions}
                                     for rep in self.resamples])
        meta = {**self.meta, "dimensions": json.dumps(self.dimensions), "cases_a": json.dumps(self.cases_a),
                "cases_b": json.dumps(self.cases_b), "empty": json.dumps(self.empty), **stamp("diff")}
        save_file(tensors, str(out / DIFF_FILE), metadata=meta)
        (out / TOP_FILE).unlink(missing_ok=True)
        if self.top_cases:
            save_sides(out / TOP_FILE, self.top_cases)
        layers = self.layer_summary(fdr)
        (out / "layers.json").write_text(json.dumps(layers, indent=1))
        units = self.ranked_units(top_n)
        (out / "units.json").write_text(json.dumps(units, indent=1))
        with (out / "units.csv").open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(units[0]) if units else ["dimension"])
            writer.writeheader()
            writer.writerows(units)
        (out / "summary.json").write_text(json.dumps(self.summary(layers, fdr), indent=1))
        return out

    def summary(self, layers: list[dict] | None = None, fdr: float = 0.05) -> dict:
        """Per dimension: cases, mean |delta|, units significant at BH q < fdr (frequency and effect tests), the peak
        layer; and the dimension with the largest shift. `layers`: `layer_summary(fdr)`'s rows (computed when
        omitted)."""
        layers = self.layer_summary(fdr) if layers is None else layers
        per_dim = {}
        for d in self.dimensions:
            rows = [r for r in layers if r["dimension"] == d]
            peak = max(rows, key=lambda r: r["mean_abs_delta"])
            per_dim[d] = {
                "cases_a": self.cases_a.get(d), "cases_b": self.cases_b.get(d),
                "mean_abs_delta": float(self.delta[d].abs().mean()),
                "significant_units": int((self.qvalue[d] < fdr).sum()) if self.tested else None,
                "significant_effect_units": int((self.effect_q[d] < fdr).sum()) if self.effect_tested else None,
                "peak_layer": peak["layer"], "peak_layer_mean_abs_delta": peak["mean_abs_delta"],
            }
        ranked = sorted(per_dim, key=lambda d: -per_dim[d]["mean_abs_delta"])
        return {"a": self.meta.get("a"), "b": self.meta.get("b"), "hook": self.hook,
                "test": self.test, "test_label": TEST_LABELS[self.test], **({} if self.tested else {"no_test": NO_TEST_WHY}),
                "effect_test": self.effect_test, "effect_test_label": TEST_LABELS[self.effect_test], "fdr": fdr,
                "dimensions": per_dim, "largest_shift": ranked[0] if ranked else None,
                "not_compared": self.empty, "stability": self.stability()}

    @property
    def resampled_dimensions(self) -> list[str]:
        """The dimensions every replicate compared (all of them, without replicates)."""
        return [d for d in self.dimensions if all(d in rep.delta for rep in self.resamples)]

    def stability(self, per_layer: Sequence[int] = STABILITY_PER_LAYER) -> list[dict]:
        """Per dimension, selector (each of `probe.selectors` that reads a diff of this one's token policy) and units per
        layer: how alike the units ranked highest in the full sample and in each
        replicate are (`resample.selection_overlap`); [] without replicates. The units are those `intervene select
        --per-layer K --direction both` takes."""
        methods = [s for s in selectors.table() if s.reads_diff_of(self.meta["tokens"])]
        rows = []
        for d in self.resampled_dimensions if self.resamples else []:
            for method in methods:
                full, *reps = (top_per_layer(method.view(x, d), per_layer) for x in (self, *self.resamples))
                rows += [{"dimension": d, "method": method.name, "budget": f"{k}/layer",
                          **selection_overlap(full[b], torch.stack([r[b] for r in reps]))} for b, k in enumerate(per_layer)]
        return rows

    def largest_shift(self) -> str | None:
        """The dimension whose units moved most (largest mean |delta|), as `summary()["largest_shift"]`."""
        return max(self.dimensions, key=lambda d: float(self.delta[d].abs().mean()), default=None)


def check_comparable(a: ProbeCounts, b: ProbeCounts, keys: Sequence[str] = COMPARABLE_KEYS,
                     names: tuple[str, str] | None = None) -> None:
    """Refuse two probe files whose metadata differ at `keys` (by default the counting settings, COMPARABLE_KEYS);
    the message names the files (`names`, when given) and the keys."""
    diffs = [f"{key}: {a.meta.get(key)!r} vs {b.meta.get(key)!r}" for key in keys if a.meta.get(key) != b.meta.get(key)]
    if diffs:
        files = f" {names[0]} and {names[1]}" if names else ""
        raise ProbeMismatchError(f"probe files{files} are not comparable (" + "; ".join(diffs) + ")")


Probe = ProbeCounts | PairedCounts | str | os.PathLike
Test = Callable[[str], tuple[torch.Tensor, torch.Tensor]]  # dimension -> (statistic, p) per unit
Named = tuple[Test | None, str]  # a per-unit test (None: no test) and its code


def diff(a: Probe, b: Probe | None = None, *, models: tuple[int, int] = (0, 1)) -> DiffResult:
    """Compare probe a (e.g. SFT) with probe b (e.g. DPO): delta = freq_b - freq_a per dimension.

    Two unpaired probe files: the two-proportion z-test per unit (tokens=last; no test for tokens=all).
    One paired probe file (b omitted): models[0] vs models[1] of it, with the exact McNemar test per unit
    (tokens=last) or the paired t-test on per-case token shares (tokens=all).
    The standardized effect (from the activation moments) is tested by Welch's t (unpaired, tokens=last; no test
    for tokens=all) or the paired t-test on per-case mean activation differences (paired, either policy).
    """
    if b is None:
        paired = a if isinstance(a, PairedCounts) else load_probe(a)
        if not isinstance(paired, PairedCounts):
            raise ProbeError(f"{a}: one model's probe file; give a second probe file, or a paired file "
                             "(`rolemrc probe collect --model A --model B ...`)")
        where = str(a) if not isinstance(a, PairedCounts) else ""
        return replace(_diff_paired(paired, *models, where),
                       resamples=[_diff_paired(rep, *models, where) for rep in paired.resamples])
    (a, name_a), (b, name_b) = _single(a), _single(b)
    check_comparable(a, b)
    resampled = len(a.resamples) == len(b.resamples)   # both with the same replicates (else the diff has none)
    return replace(_diff_single(a, b, (name_a, name_b)),
                   resamples=[_diff_single(*reps, (name_a, name_b)) for reps in zip(a.resamples, b.resamples)]
                   if resampled else [])


def _diff_single(a: ProbeCounts, b: ProbeCounts, names: tuple[str, str]) -> DiffResult:
    """Two unpaired probe files: the two-proportion z-test and Welch's t (tokens=last), no test (tokens=all)."""
    if a.meta.get("tokens") == "all":
        return _compare(a, b, names, (None, "none"), (None, "none"))

    def welch(d: str) -> tuple[torch.Tensor, torch.Tensor]:
        return welch_t_test(*a.moments(d), a.observations[d], *b.moments(d), b.observations[d])

    def frequency(d: str) -> tuple[torch.Tensor, torch.Tensor]:
        return two_proportion_test(a.count[d], a.observations[d], b.count[d], b.observations[d])

    return _compare(a, b, names, (frequency, "two-proportion-z"), (welch, "welch-t"))


def _single(x: Probe) -> tuple[ProbeCounts, str]:
    if isinstance(x, ProbeCounts):
        return x, x.meta.get("model", "")
    if isinstance(x, PairedCounts):
        raise ProbeError("a paired probe file is diffed alone (diff(paired, models=(i, j)))")
    return ProbeCounts.load(x), str(x)


def _diff_paired(paired: PairedCounts, i: int, j: int, where: str) -> DiffResult:
    paired.check_index(i, j)
    if i == j:
        raise ProbeError(f"--a and --b name the same model ({i}); pick two of 0-{len(paired.counts) - 1}")
    a, b = paired.counts[i], paired.counts[j]
    effect = (lambda d: paired_t_test(*paired.act_diff(i, j, d), a.cases[d])), "paired-t"
    if paired.meta.get("tokens") == "all":
        test = lambda d: paired_t_test(*paired.share_diff(i, j, d), a.cases[d])  # noqa: E731
        name = "paired-t"
    else:
        def test(d: str) -> tuple[torch.Tensor, torch.Tensor]:   # b01: active under j (B) only, b10: under i (A) only
            stat, p = mcnemar(paired.discordant(j, i, d).cpu(), paired.discordant(i, j, d).cpu())
            return torch.from_numpy(stat), torch.from_numpy(p)

        name = "mcnemar"
    names = tuple(f"{c.meta.get('model', '')} [model {m} of {where or 'the paired probe'}]" for c, m in ((a, i), (b, j)))
    return _compare(a, b, names, (test, name), effect)


def _compare(a: ProbeCounts, b: ProbeCounts, names: tuple[str, str], frequency: Named, effect: Named) -> DiffResult:
    """freq, delta and the frequency test, and the standardized effect and its test, per dimension (a test of None:
    statistic, p and q are NaN)."""
    (test, test_name), (effect_test, effect_name) = frequency, effect
    result = DiffResult({}, {}, {}, {}, {}, {}, meta={
        **{key: a.meta[key] for key in (*COMPARABLE_KEYS, "k") if key in a.meta},
        "a": names[0], "b": names[1], "test": test_name, "effect_test": effect_name,
        **{f"{side}_{key}": c.meta.get(key, "") for side, c in (("a", a), ("b", b))
           for key in ("model", "model_fingerprint", "model_fingerprint_of", "dtype")},
    })
    for d in a.dimensions:
        if d not in b.count:
            result.empty[d] = "only in a"
            continue
        na, nb = a.observations[d], b.observations[d]
        result.cases_a[d], result.cases_b[d] = a.cases[d], b.cases[d]
        if na == 0 or nb == 0:
            result.empty[d] = "no cases in " + " and ".join(s for s, n in (("a", na), ("b", nb)) if n == 0)
            continue
        result.freq_a[d], result.freq_b[d] = a.freq(d), b.freq(d)
        result.delta[d] = result.freq_b[d] - result.freq_a[d]
        result.z[d], result.pvalue[d], result.qvalue[d] = _tested(test, d, result.delta[d])
        (result.mean_a[d], var_a), (result.mean_b[d], var_b) = a.moments(d), b.moments(d)
        result.effect[d] = standardized_effect(result.mean_a[d], var_a, result.mean_b[d], var_b)
        result.effect_t[d], result.effect_p[d], result.effect_q[d] = _tested(effect_test, d, result.effect[d])
    for d in b.dimensions:
        if d not in a.count:
            result.empty[d] = "only in b"
    result.top_cases = {side: c.top for side, c in (("a", a), ("b", b)) if c.top is not None}
    return result


def _tested(test: Test | None, dimension: str, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(statistic, p, BH q over the dimension's units), all NaN without a test."""
    if test is None:
        return tuple(torch.full_like(like, torch.nan, dtype=torch.float64) for _ in range(3))
    statistic, p = test(dimension)
    return statistic, p, benjamini_hochberg(p)


def standardized_effect(mean_a: torch.Tensor, var_a: torch.Tensor, mean_b: torch.Tensor, var_b: torch.Tensor) -> torch.Tensor:
    """(mean_b - mean_a) / sqrt((var_a + var_b) / 2) per unit; 0 where both variances are 0."""
    pooled = ((var_a + var_b) / 2).sqrt()
    return torch.where(pooled > 0, (mean_b - mean_a) / pooled.clamp_min(1e-300), torch.zeros_like(pooled))


def top_per_layer(view: View, per_layer: Sequence[int]) -> list[torch.Tensor]:
    """Per k of `per_layer`, bool [layers * width]: the k units of each layer that `intervene select --per-layer k`
    takes from a selector's view (score != 0, `ranking.rank_units` order)."""
    score = view.score
    order = rank_units(score, view.q)
    order = order[moved(score, "both").reshape(-1)[order]]
    layer = torch.arange(score.numel()) // score.shape[1]
    masks = torch.zeros(len(per_layer), score.numel(), dtype=torch.bool)
    for mask, k in zip(masks, per_layer):
        mask[order[first_per_group(order, layer, k)]] = True
    return list(masks)


def load_diff(path: str | os.PathLike) -> DiffResult:
    """Load a diff from its directory or its diff.safetensors file."""
    path = Path(path)
    expect(path, ("diff", "diff-file"), "expected a diff folder (from `rolemrc probe diff`)")
    file = path / DIFF_FILE if path.is_dir() else path
    meta, tensors = read_tensors(file, "diff file",
                                 missing="no diff file (run `rolemrc probe diff A B --out DIR` first)")
    if meta.get("kind") != "diff":
        raise ProbeError(f"{file} is {describe(file)}; expected a diff file (from `rolemrc probe diff`)")
    check_format(file, meta, "diff")
    dims = json.loads(meta.pop("dimensions"))
    tables = {name: {d: tensors[f"{name}.{d}"] for d in dims}
              for name in ("freq_a", "freq_b", "delta", "z", "pvalue", "qvalue", *EFFECT_TABLES)}
    resampled = [name.removeprefix(f"{RESAMPLED}delta.") for name in tensors if name.startswith(f"{RESAMPLED}delta.")]
    resamples = [DiffResult(freq_a={}, freq_b={}, z={}, pvalue={}, meta=meta, **{
        name: {d: view[f"{name}.{d}"] for d in resampled} for name in RESAMPLED_TABLES})
        for view in (replicate_tensors(tensors, r) for r in range(resample_count(tensors)))]
    return DiffResult(**tables, meta=meta, cases_a=json.loads(meta.pop("cases_a", "{}")),
                      cases_b=json.loads(meta.pop("cases_b", "{}")), empty=json.loads(meta.pop("empty", "{}")),
                      top_cases=load_sides(file.parent / TOP_FILE), resamples=resamples)


def top_set_jaccard(freq_a: torch.Tensor, freq_b: torch.Tensor, k: int) -> torch.Tensor:
    """Per row (layer): Jaccard index of the k most frequent units under a and under b."""
    layers, width = freq_a.shape
    k = min(k, width)
    mask_a = torch.zeros(layers, width, dtype=torch.bool).scatter_(1, freq_a.topk(k, dim=1).indices, True)
    mask_b = torch.zeros(layers, width, dtype=torch.bool).scatter_(1, freq_b.topk(k, dim=1).indices, True)
    inter = (mask_a & mask_b).sum(1).double()
    union = (mask_a | mask_b).sum(1).double()
    return inter / union
