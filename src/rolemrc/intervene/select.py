"""Selecting a restraint: `scores_of`, a selector's scores read from its input, and `select`, which turns them into a
`Restraint`. The selectors themselves are one table, `probe.selectors.SELECTORS`.

A selector reads its input (a probe diff, or an attribution file; or the loaded `DiffResult` / `Attribution`) and gives
each unit of a dimension a signed score (> 0: the unit moved up from A to B, or its change raised B's preference) and,
where its input carries a per-unit test, BH q-values. `select` applies layers, direction and a budget (`intervene.budget`)
to any selector's scores in one order (|score| descending, q ascending, layer, unit: `probe.ranking.rank_units`) and
writes the same spec; its method and factor are named, or come from a calibration's recommendation. Imports no
torch until `select` runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from rolemrc.intervene.budget import BUDGET_OPTIONS, EXACTLY_ONE, Budget, coverage, one_budget
from rolemrc.intervene.inputs import IN_MEMORY, input_file, model_of, role_meta
from rolemrc.intervene.recommendation import load_recommendation
from rolemrc.intervene.spec import PAPER_FACTOR, Restraint, RestraintError, parse_layers
from rolemrc.probe.options import DIRECTIONS, Direction
from rolemrc.probe.selectors import SELECTORS, for_tokens, readers

if TYPE_CHECKING:
    import torch

    from rolemrc.probe.attribution import Attribution
    from rolemrc.probe.diff import DiffResult

Source: TypeAlias = "str | os.PathLike | DiffResult | Attribution"   # a selector's input: a path, or its loaded object
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scores:
    """One dimension's per-unit scores from a selector's input."""

    score: torch.Tensor            # [layers, width] signed: direction by its sign, ranked by |score|
    q: torch.Tensor | None         # BH q per unit (None: the input has no test here; fdr is refused)
    hook: str                      # the input's hook point
    origin: str                    # the file read, or IN_MEMORY
    no_q: str = ""                 # why there are no q-values
    model: dict[str, str] = field(default_factory=dict)   # the model the scores are of (the diff's B, the DPO model)
    reference: dict[str, str] = field(default_factory=dict)   # the model it is compared with (the diff's A, the SFT)


def select(source: Source, dimension: str, *, method: str | None = None, factor: float | None = None,
           top_k: int | None = None, per_layer: int | None = None, share: float | None = None, fdr: float | None = None,
           calibration: str | os.PathLike | None = None, layers: str | None = None, direction: Direction = "both",
           name: str | None = None, kind: str = "scale", alpha: float | None = None,
           means: Source | None = None) -> Restraint:
    """Units of `dimension` that `method` (a name in SELECTORS) ranks highest, in `probe.ranking.rank_units` order
    (|score| descending, q ascending, layer, unit), scaled by `factor` (0 ablates; `PAPER_FACTOR` is the paper's).
    No default picks them: name method and factor, or give `calibration` (a calibration folder or its
    calibration.json), whose recommendation supplies method, budget and factor.

    kind (`intervene.kinds.SELECTED_KINDS`): scale (by `factor`), patch (each unit set to its mean activation under
    the SFT model, read from `means`, a diff; default the source when it is one) or revert (the units' weights moved
    toward the SFT model the input records, by `alpha`); patch and revert take no factor.

    source: the selector's input: a diff directory or file, or a `DiffResult` (an attribution file or an
    `Attribution` for `attribution`); a spec selected from an object records its source as "in memory".
    Budget, exactly one of (`intervene.budget`): top_k (over all chosen layers), per_layer (exactly K from each chosen
    layer), share (round(S x all units of the chosen layers)), fdr (every unit with BH q < fdr; selectors with a test).
    direction: both (score != 0), up (score > 0: more under B) or down (score < 0).
    The spec's source records the budget and what it covers (units per layer, share of all units).
    """
    import torch

    from rolemrc.intervene.kinds import SELECTED_KINDS, as_patch, as_revert

    if kind not in SELECTED_KINDS:
        raise RestraintError(f"select makes a restraint of kind {' | '.join(SELECTED_KINDS)} (a direction comes from "
                             f"`intervene.kinds.direction_restraint`), not {kind!r}")
    if kind != "scale" and (factor is not None or calibration is not None):
        raise RestraintError(f"a {kind} takes no --factor or --calibration" + (": give --alpha" if kind == "revert" else ""))
    if (kind == "revert") != (alpha is not None):
        raise RestraintError("--alpha belongs to a revert, which needs it" if alpha is None or kind == "revert"
                             else f"--alpha belongs to a revert, not a {kind}")
    if means is not None and kind != "patch":
        raise RestraintError(f"--means belongs to a patch, not a {kind}")
    method, budget, factor = recipe(method, 1.0 if kind != "scale" else factor, calibration, top_k=top_k,
                                    per_layer=per_layer, share=share, fdr=fdr)
    entry = SELECTORS.get(method)
    if direction not in DIRECTIONS:
        raise RestraintError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    scores = scores_of(method, Path(source) if isinstance(source, str | os.PathLike) else source, dimension)
    flat, allowed = selected_units(scores, method, budget, layers, direction)
    n_layers, n_units = scores.score.shape
    if len(flat) == 0:
        raise RestraintError(f"no unit of {dimension!r} qualifies (method {method}, layers {layers or 'all'}, direction "
                             f"{direction}, {budget.label})")
    counts = torch.bincount(flat // n_units, minlength=n_layers)
    if budget.kind == "per_layer" and bool((counts[allowed] < budget.value).any()):
        short = allowed & (counts < budget.value)
        log.warning("%s: %d of %d layers have fewer than %d units that moved (%s), so they give what they have",
                    scores.origin, int(short.sum()), int(allowed.sum()), budget.value, direction)
    ids = flat.sort().values
    units = {layer: chunk.remainder(n_units).tolist()
             for layer, chunk in zip(counts.nonzero().squeeze(1).tolist(), ids.split(counts[counts > 0].tolist()))}
    spec_source = {entry.reads: scores.origin, "method": method, "dimension": dimension,
                   "direction": direction, "layers": layers or "all", **budget.to_dict(),
                   "coverage": coverage(counts[allowed].tolist(), n_units, n_layers),
                   **({"calibration": str(calibration)} if calibration is not None else {})}
    model = scores.model and {**scores.model, "layers": n_layers, "width": n_units}
    if kind == "scale" and factor == PAPER_FACTOR:
        log.warning(paper_factor_note(scores.model.get("dtype")))
    r = Restraint(name=name or f"{dimension.replace('_', '-')}-restraint", hook=scores.hook, units=units,
                  factor=factor, source=spec_source, model=model)
    if kind == "patch":
        if means is None and entry.reads != "diff":
            raise RestraintError(f"a patch of {method}'s units needs --means, a diff of the same pair whose A side's "
                                 "mean activations the units are set to")
        return as_patch(r, source if means is None else means, dimension)
    return as_revert(r, alpha, scores.reference) if kind == "revert" else r


def selected_units(scores: Scores, method: str, budget: Budget, layers: str | None,
                   direction: Direction) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat ids, layer * width + unit, of the units the budget takes, best first; bool [layers]: the chosen layers):
    the units of `layers` that moved in `direction` (under q < the budget's with fdr), in `rank_units` order, cut
    by the budget. Possibly none."""
    import torch

    from rolemrc.probe.ranking import first_per_group, moved, rank_units

    if budget.kind == "fdr" and scores.q is None:
        raise RestraintError(f"{scores.origin}: --method {method} has no q-values here ({scores.no_q}); choose "
                             f"{EXACTLY_ONE} but --fdr")
    score = scores.score.double()
    q = scores.q.double() if scores.q is not None else None
    n_layers, n_units = score.shape
    chosen = parse_layers(layers, n_layers)
    allowed = torch.zeros(n_layers, dtype=torch.bool)
    allowed[chosen if chosen is not None else slice(None)] = True
    eligible = allowed[:, None] & moved(score, direction)
    if budget.kind == "fdr":
        eligible &= q < budget.value   # q is not None: refused above
    order = rank_units(score, q)
    flat = order[eligible.reshape(-1)[order]]   # every eligible unit, best first
    if budget.kind == "per_layer":
        layer_of = torch.arange(n_layers).repeat_interleave(n_units)   # flat id -> its layer
        flat = flat[first_per_group(flat, layer_of, int(budget.value))]
    elif budget.kind in ("top_k", "share"):
        flat = flat[:budget.value if budget.kind == "top_k" else round(budget.value * int(allowed.sum()) * n_units)]
    return flat, allowed


def recipe(method: str | None, factor: float | None, calibration: str | os.PathLike | None,
           **budget: float | None) -> tuple[str, Budget, float]:
    """(method, budget, factor): as named, or from a calibration's recommendation; never a silent default."""
    if calibration is not None:
        named = [o for o, v in (("--method", method), ("--factor", factor),
                                *((BUDGET_OPTIONS[k], v) for k, v in budget.items())) if v is not None]
        if named:
            raise RestraintError(f"--calibration supplies the method, budget and factor: drop {', '.join(named)}")
        return load_recommendation(calibration).recipe()
    if method is None or factor is None:
        missing = " and ".join(o for o, v in (("--method", method), ("--factor", factor)) if v is None)
        raise RestraintError(f"select needs {missing} named (--method: {SELECTORS.listing(' | ')}; --factor: 0 "
                             f"ablates, the paper's is {PAPER_FACTOR:.10g}), or --calibration FOLDER (a calibration's "
                             "recommendation supplies method, budget and factor); what the calibration found about "
                             "each: docs/calibration.md")
    SELECTORS.check([method])
    if method == "frequency":
        log.warning(FREQUENCY_WARNING)
    return method, one_budget(**budget), float(factor)


FREQUENCY_WARNING = ("--method frequency reproduces the paper; on the calibration it undid no planted change but a "
                     "collapsed organism's (docs/calibration.md)")


@contextmanager
def warnings_once() -> Iterator[None]:
    """While the block runs, each distinct warning of `select` is logged once (a grid selects many times)."""
    seen: set[str] = set()

    def first(record: logging.LogRecord) -> bool:
        new = record.getMessage() not in seen
        seen.add(record.getMessage())
        return new

    log.addFilter(first)
    try:
        yield
    finally:
        log.removeFilter(first)


def paper_factor_note(dtype: str | None) -> str:
    """One line on the paper's factor 1 - 1e-6 at the dtype the selected units' model was probed at."""
    import torch

    head = f"factor {PAPER_FACTOR:.10g} is the paper's factor: "
    checked = "; `rolemrc intervene check` measures whether any verdict moves"
    at = getattr(torch, dtype, None) if dtype else None
    if not isinstance(at, torch.dtype):
        return (head + "the dtype the model was probed at is not recorded; it rounds to 1.0 (an exact no-op) in "
                "bfloat16 and float16, and changes each selected activation by 1e-6 relative in float32, where the "
                "calibration saw no verdict move (docs/calibration.md)" + checked)
    rounded = torch.tensor(PAPER_FACTOR, dtype=at).item()
    if rounded == 1.0:
        return head + f"it rounds to 1.0 in {dtype}, the dtype the model was probed at: an exact no-op there" + checked
    return (head + f"in {dtype}, the dtype the model was probed at, it changes each selected activation by "
            f"{1 - rounded:.2g} relative; the calibration saw no verdict move at it (docs/calibration.md)" + checked)


def scores_of(method: str, source: Source, dimension: str) -> Scores:
    """Selector `method`'s scores of `dimension` in its input (a path, or the loaded `DiffResult` / `Attribution`);
    refuses an input of the wrong kind, a dimension it lacks, or a diff of another token policy than the selector's."""
    from rolemrc.probe.attribution import Attribution, load_attribution
    from rolemrc.probe.diff import DiffResult, load_diff

    entry = SELECTORS.get(method)
    wrong = Attribution if entry.reads == "diff" else DiffResult
    if isinstance(source, wrong):
        other = " or ".join(f"method={n!r}" for n in readers("attribution" if entry.reads == "diff" else "diff"))
        raise RestraintError(f"--method {method} reads {INPUTS[entry.reads]}, not a{'n' * (wrong is Attribution)} "
                             f"{wrong.__name__}: use {other}")
    if isinstance(source, DiffResult | Attribution):
        loaded, origin = source, IN_MEMORY
    elif entry.reads == "diff":
        loaded, origin = load_diff(source), str(input_file(source))
    else:
        loaded, origin = load_attribution(source), str(source)
    if entry.reads == "diff":
        if dimension not in loaded.delta:
            why = loaded.empty.get(dimension)
            raise RestraintError(f"dimension {dimension!r} is not in the diff" + (f" ({why})" if why else "")
                                 + f"; compared: {loaded.dimensions}")
        made = loaded.meta["tokens"]   # diffs record the probe files' token policy
        if not entry.reads_diff_of(made):
            raise RestraintError(f"{origin}: a diff of tokens={made} probe files, but --method {method} reads "
                                 f"tokens={entry.tokens} ones: use --method {' or '.join(for_tokens(made))}, or diff "
                                 f"probe files made with `rolemrc probe collect --tokens {entry.tokens}`")
        hook, model, reference = loaded.hook, model_of(loaded.meta, "b_"), model_of(loaded.meta, "a_")
    else:
        if dimension not in loaded.scores:
            where = "the Attribution" if origin == IN_MEMORY else f"the attribution file {origin}"
            raise RestraintError(f"dimension {dimension!r} is not in {where} (or has no pairs); it has: "
                                 f"{sorted(loaded.scores)}")
        hook, model, reference = (loaded.meta["hook"], model_of(role_meta(loaded.meta)),
                                  model_of(role_meta(loaded.meta, "sft")))
    view = entry.view(loaded, dimension)
    return Scores(view.score, view.q, hook, origin, no_q=view.no_q, model=model, reference=reference)


INPUTS = {"diff": "a probe diff (a `rolemrc probe diff` folder, or a DiffResult)",
          "attribution": "an attribution (a file from `rolemrc probe attribute`, or an Attribution)"}
