"""Unit selectors: how `intervene select` ranks a dimension's units, as a registry (`SELECTORS`, like eval's metrics).

A selector reads its input (a probe diff, or an attribution file; or the loaded `DiffResult` / `Attribution`) and gives
each unit of a dimension a signed score
(> 0: the unit moved up from A to B, or its change raised B's preference) and, where its input carries a per-unit test,
BH q-values. `intervene.select.select` applies layers, direction, top_k or fdr to any selector's scores in one order
(|score| descending, q ascending, layer, unit: `probe.ranking.rank_units`) and writes the same `Restraint` spec. Adding
a selector is one `@selector(...)` function. This module imports no torch (the CLI's help lists the registry).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from rolemrc.core.artifacts import expect
from rolemrc.core.registry import Registry
from rolemrc.intervene.spec import RestraintError

if TYPE_CHECKING:
    import torch

    from rolemrc.probe.attribution import Attribution
    from rolemrc.probe.diff import DiffResult

Source: TypeAlias = "str | os.PathLike | DiffResult | Attribution"   # a selector's input: a path, or its loaded object
IN_MEMORY = "in memory"   # a source's origin when it was handed over as an object


@dataclass(frozen=True)
class Scores:
    """One dimension's per-unit scores from a selector's input."""

    score: torch.Tensor            # [layers, width] signed: direction by its sign, ranked by |score|
    q: torch.Tensor | None         # BH q per unit (None: the input has no test here; fdr is refused)
    hook: str                      # the input's hook point
    origin: str                    # the file read, or IN_MEMORY
    no_q: str = ""                 # why there are no q-values
    model: dict[str, str] = field(default_factory=dict)   # the model the scores are of (the diff's B, the DPO model)


def dpo_meta(meta: dict[str, str]) -> dict[str, str]:
    """An attribution's DPO model metadata (its `models`: by role, or a list in the order sft, dpo)."""
    models = json.loads(meta.get("models") or "{}")
    found = models.get("dpo") if isinstance(models, dict) else (models[-1] if models else None)
    return found if isinstance(found, dict) else {}


def model_of(meta: dict[str, str], prefix: str = "") -> dict[str, str]:
    """The identity of a probed model as a restraint spec records it (from a probe's or a diff's metadata, the
    diff's keys with prefix "b_"); {} when the metadata has no fingerprint."""
    if not meta.get(f"{prefix}model_fingerprint"):
        return {}
    name = meta.get(f"{prefix}model") or meta.get(prefix.rstrip("_"), "")   # diffs before names: the side's label
    return {"name": name, "fingerprint": meta[f"{prefix}model_fingerprint"],
            "fingerprint_of": meta.get(f"{prefix}model_fingerprint_of", "")}


ScoreFn = Callable[[Source, str], Scores]   # (input, dimension) -> Scores


@dataclass(frozen=True)
class Selector:
    """A registered selector: `scores(source, dimension)` and what it is, for help texts and the spec."""

    scores: ScoreFn
    description: str
    reads: str    # the input it reads: "diff" or "attribution" (also the restraint source's key for that file)
    ranks: str    # how it ranks


SELECTORS: Registry[Selector] = Registry("selector")


def selector(name: str, *, description: str, reads: str, ranks: str) -> Callable[[ScoreFn], ScoreFn]:
    """Decorator registering `fn(source, dimension) -> Scores` as selector `name`."""
    def add(fn: ScoreFn) -> ScoreFn:
        SELECTORS.register(name)(Selector(fn, description, reads, ranks))
        return fn
    return add


def selectors_help() -> str:
    """One line per selector: name, what it reads, how it ranks (for `intervene select --help`)."""
    return "; ".join(f"{name}: {s.description} (input: {s.reads}; rank: {s.ranks})"
                     for name, s in ((n, SELECTORS.get(n)) for n in SELECTORS.names()))


def input_file(path: str | os.PathLike) -> Path:
    """A selector's input file: a diff directory's diff.safetensors, else the path itself."""
    from rolemrc.probe.diff import DIFF_FILE

    path = Path(path)
    return path / DIFF_FILE if path.is_dir() else path


def input_hook(path: str | os.PathLike) -> str:
    """The hook point a selector's input (a diff, or an attribution file) was measured at."""
    from rolemrc.probe.counts import read_tensors

    expect(path, ("diff", "diff-file", "attribution"), "a selector reads a diff folder (from `rolemrc probe diff`) or "
           "an attribution file (from `rolemrc probe attribute`)")
    return read_tensors(input_file(path), "diff or attribution file", missing="no such diff or attribution file")[0]["hook"]


TOKEN_METHODS = {"last": "frequency", "all": "frequency-all"}  # a diff's token policy -> its frequency selector


@selector("frequency", reads="diff", ranks="|freq_b - freq_a|, then the diff's q",
          description="the paper's: change in top-fraction frequency at the last prompt token")
def frequency(source: Source, dimension: str) -> Scores:
    return _frequency(source, dimension, "last")


@selector("frequency-all", reads="diff", ranks="|freq_b - freq_a|, then the diff's q",
          description="the same over every prompt token (tokens=all probe files)")
def frequency_all(source: Source, dimension: str) -> Scores:
    return _frequency(source, dimension, "all")


@selector("standardized", reads="diff", ranks="|effect|, then the effect test's q",
          description="mean activation change over the pooled per-unit SD (the diff's effect)")
def standardized(source: Source, dimension: str) -> Scores:
    result, file = _diff(source, dimension)
    if dimension not in result.effect:
        raise RestraintError(f"{file}: the diff has no standardized effect ({result.effect_test}); collect the probe "
                             "files again with `rolemrc probe collect` and rerun `rolemrc probe diff`")
    q = result.effect_q[dimension] if result.effect_tested else None
    return Scores(result.effect[dimension], q, result.hook, file, no_q=f"effect test: {result.effect_test}",
                  model=model_of(result.meta, "b_"))


@selector("attribution", reads="attribution", ranks="mean score per pair, no q",
          description="DPO preference-margin gradient times the SFT -> DPO activation change, over preference pairs")
def attribution(source: Source, dimension: str) -> Scores:
    from rolemrc.probe.attribution import Attribution, load_attribution
    from rolemrc.probe.diff import DiffResult

    if isinstance(source, DiffResult):
        raise RestraintError("--method attribution reads an attribution (a file from `rolemrc probe attribute`, or "
                             "an Attribution), not a DiffResult")
    loaded, origin = (source, IN_MEMORY) if isinstance(source, Attribution) else (load_attribution(source), str(source))
    scores, meta = loaded.scores, loaded.meta
    if dimension not in scores:
        where = "the Attribution" if origin == IN_MEMORY else f"the attribution file {origin}"
        raise RestraintError(f"dimension {dimension!r} is not in {where} (or has no pairs); it has: {sorted(scores)}")
    return Scores(scores[dimension], None, meta["hook"], origin, no_q="attribution scores carry no test",
                  model=model_of(dpo_meta(meta)))


def _frequency(source: Source, dimension: str, tokens: str) -> Scores:
    result, file = _diff(source, dimension)
    made = result.meta.get("tokens", "last")   # diffs record the probe files' token policy
    if made != tokens:
        raise RestraintError(f"{file}: a diff of tokens={made} probe files, but --method {TOKEN_METHODS[tokens]} reads "
                             f"tokens={tokens} ones: use --method {TOKEN_METHODS[made]}, or diff probe files made with "
                             f"`rolemrc probe collect --tokens {tokens}`")
    q = result.qvalue[dimension] if result.tested else None
    return Scores(result.delta[dimension], q, result.hook, file, no_q=f"test: {result.test}",
                  model=model_of(result.meta, "b_"))


def _diff(source: Source, dimension: str) -> tuple[DiffResult, str]:
    """The diff (a directory, its file, or a DiffResult) and its origin; refuses a dimension it did not compare."""
    from rolemrc.probe.attribution import Attribution
    from rolemrc.probe.diff import DiffResult, load_diff

    if isinstance(source, Attribution):
        raise RestraintError("this selector reads a probe diff (a `rolemrc probe diff` folder, or a DiffResult), not an "
                             "Attribution: use method='attribution'")
    result, origin = (source, IN_MEMORY) if isinstance(source, DiffResult) else (load_diff(source), str(input_file(source)))
    if dimension not in result.delta:
        why = result.empty.get(dimension)
        raise RestraintError(f"dimension {dimension!r} is not in the diff" + (f" ({why})" if why else "")
                             + f"; compared: {result.dimensions}")
    return result, origin
