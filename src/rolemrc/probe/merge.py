"""`merge`: sum probe files counted over disjoint cases (shards collected anywhere) into the one file a single
collection over all their cases would give (docs/ARCHITECTURE.md "Probe file")."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from rolemrc.core.version import __version__
from rolemrc.probe.attribution import ATTRIBUTION_KEYS, Attribution, is_attribution_file, load_attribution
from rolemrc.probe.cases import cases_fingerprint, dimension_order
from rolemrc.probe.counts import COMPARABLE_KEYS, ProbeCounts
from rolemrc.probe.diff import Probe, ProbeMismatchError, check_comparable
from rolemrc.probe.errors import ProbeError
from rolemrc.probe.paired import MODEL_KEYS, NAME_KEYS, PairedCounts, load_probe
from rolemrc.probe.topcases import merge_top

# Metadata that must agree for counts to add up: the counting settings, and each model's identity at its dtype.
MERGE_KEYS = (*COMPARABLE_KEYS, "k", "backend", "max_length", "dimension_field", "top_cases", "resamples",
              *(key for key in MODEL_KEYS if key not in (*NAME_KEYS, "model_fingerprint_of")))   # the fingerprint says it


def merge(probes: Sequence[Probe]) -> ProbeCounts | PairedCounts:
    """Sum probe files (paths, or loaded probes) of the same model(s) and counting settings over disjoint
    cases: counts, cases, observations and paired statistics add up, replicate by replicate too (probe/resample.py),
    and each unit's top cases merge. Refuses files
    that are not comparable (MERGE_KEYS, checked as `probe diff` checks) or that share a case (`case_hashes`)."""
    if len(probes) < 2:
        raise ProbeError(f"merging needs two or more probe files, got {len(probes)}")
    names = [str(p) if isinstance(p, (str, os.PathLike)) else f"probe {i}" for i, p in enumerate(probes)]
    loaded = [load_probe(p) if isinstance(p, (str, os.PathLike)) else p for p in probes]
    models = [x.counts if isinstance(x, PairedCounts) else [x] for x in loaded]
    parts = [counts[0].case_hashes for counts in models]
    for name, probe, counts in zip(names[1:], loaded[1:], models[1:]):
        if type(probe) is not type(loaded[0]) or len(counts) != len(models[0]):
            raise ProbeMismatchError(f"probe files {names[0]} and {name} are not comparable "
                                     f"({_kind(loaded[0])} vs {_kind(probe)})")
        for first, other in zip(models[0], counts):
            check_comparable(first, other, MERGE_KEYS, (names[0], name))
    hashes = _disjoint_cases(names, parts)
    fingerprint = cases_fingerprint(hashes)
    meta = {**loaded[0].meta, "cases_fingerprint": fingerprint, "data_fingerprint": fingerprint,
            "truncated": str(sum(int(x.meta["truncated"]) for x in loaded)), "toolkit_version": __version__,
            "merged_from": json.dumps([{"file": name, "data_fingerprint": x.meta.get("data_fingerprint", ""), "cases": len(h)}
                                       for name, x, h in zip(names, loaded, parts)])}
    seen = {d for counts in models for d in counts[0].dimensions}
    dims = dimension_order(seen, bool(meta.get("dimension_field")))
    summed = [_sum([counts[m] for counts in models], dims, hashes) for m in range(len(models[0]))]
    resamples = [merge([x.resamples[r] for x in loaded]) for r in range(len(loaded[0].resamples))]
    if not isinstance(loaded[0], PairedCounts):
        summed[0].meta, summed[0].resamples = meta, resamples
        return summed[0]
    for m, counts in enumerate(summed):
        counts.meta = {**meta, **{key: loaded[0].counts[m].meta.get(key, "") for key in MODEL_KEYS}}
    keys = dict.fromkeys(key for x in loaded for key in x.pair_stats)
    stats = {key: _add([x.pair_stats[key] for x in loaded if key in x.pair_stats]) for key in keys}
    return PairedCounts(summed, stats, meta, resamples)


def merge_files(paths: Sequence[str | os.PathLike], out: str | os.PathLike) -> Path:
    """merge() (merge_attribution() for attribution files) and save the result."""
    return merge_any(paths).save(out)


def merge_any(paths: Sequence[str | os.PathLike]) -> ProbeCounts | PairedCounts | Attribution:
    """merge() of probe files or merge_attribution() of attribution files; refuses a mix of the two kinds."""
    kinds = [is_attribution_file(p) for p in paths]
    if any(kinds) and not all(kinds):
        raise ProbeMismatchError(f"{paths[kinds.index(True)]} is an attribution file and {paths[kinds.index(False)]} is "
                                 "not: merge attribution files with attribution files only")
    return merge_attribution(paths) if any(kinds) else merge(paths)


def merge_attribution(paths: Sequence[str | os.PathLike]) -> Attribution:
    """Sum attribution files of the same models and settings over disjoint pairs into the file one pass over all
    their pairs gives (each pair's score is an integer of SCORE_UNITs: exact in any order; replicates add up too).
    Refuses files of another hook, shape, policy or models (fingerprints and dtype), and files that share a pair
    (`case_hashes`)."""
    if len(paths) < 2:
        raise ProbeError(f"merging needs two or more attribution files, got {len(paths)}")
    names, loaded = [str(p) for p in paths], [load_attribution(p) for p in paths]
    for name, other in zip(names[1:], loaded[1:]):
        check_comparable(loaded[0], other, ATTRIBUTION_KEYS, (names[0], name))
        if other.model_identity != loaded[0].model_identity:
            raise ProbeMismatchError(f"attribution files {names[0]} and {name} are not comparable (models: "
                                     f"{loaded[0].model_identity} vs {other.model_identity})")
    hashes = _disjoint_cases(names, [x.case_hashes for x in loaded])
    fingerprint = cases_fingerprint(hashes)
    dims = dimension_order({d for x in loaded for d in x.dimensions}, bool(loaded[0].meta["dimension_field"]))
    per_run = ("batch_size", "peak_memory_gib")   # how each file's run went: kept per file
    meta = {**{k: v for k, v in loaded[0].meta.items() if k not in per_run}, "data_fingerprint": fingerprint,
            "pairs_fingerprint": fingerprint, "truncated": str(sum(int(x.meta["truncated"]) for x in loaded)),
            "toolkit_version": __version__,
            "merged_from": json.dumps([{"file": name, "data_fingerprint": x.meta["data_fingerprint"], "pairs": len(x.case_hashes),
                                        **{k: x.meta.get(k, "") for k in per_run}} for name, x in zip(names, loaded)])}
    return _sum_attributions(loaded, dims, meta, hashes)


def _sum_attributions(parts: list[Attribution], dims: list[str], meta: dict[str, str], hashes: torch.Tensor) -> Attribution:
    """The parts' score sums and pair counts added up, replicate by replicate too."""
    resamples = [_sum_attributions([x.resamples[r] for x in parts], dims, meta, hashes)
                 for r in range(len(parts[0].resamples))]
    return Attribution({d: _add([x.sums[d] for x in parts if d in x.sums]) for d in dims},
                       {d: sum(x.pairs.get(d, 0) for x in parts) for d in dims}, meta, hashes, resamples)


def _kind(probe: ProbeCounts | PairedCounts) -> str:
    return f"a paired file of {len(probe.counts)} models" if isinstance(probe, PairedCounts) else "one model's counts"


def _disjoint_cases(names: list[str], hashes: list[torch.Tensor]) -> torch.Tensor:
    """The sorted union of the inputs' case hashes; refuses inputs that share a case."""
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            shared = int(torch.isin(hashes[i], hashes[j]).sum())
            if shared:
                raise ProbeError(f"probe files {names[i]} and {names[j]} share {shared} case(s) (same record id, prompt "
                                 "and dimensions): merging would count them twice; merge files of disjoint cases")
    return torch.cat(hashes).sort().values


def _add(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(tensors).sum(0)


def _sum(parts: list[ProbeCounts], dims: list[str], hashes: torch.Tensor) -> ProbeCounts:
    """One model's counts and activation moments summed over the parts (a dimension a part lacks counts zero there),
    and its top cases merged."""
    def total(table: str) -> dict[str, torch.Tensor]:
        return {d: _add([getattr(p, table)[d] for p in parts if d in p.count]) for d in dims}

    return ProbeCounts(
        count=total("count"),
        cases={d: sum(p.cases.get(d, 0) for p in parts) for d in dims},
        observations={d: sum(p.observations.get(d, 0) for p in parts) for d in dims},
        case_hashes=hashes,
        act_sum=total("act_sum"),
        act_sq=total("act_sq"),
        top=merge_top([(p.top, p.case_hashes) for p in parts], hashes) if parts[0].top is not None else None,
    )
