"""The sweep's plan: a grid of cells (dimension x budget x factor), each with seeded random controls of its kind, and
one shared unrestrained baseline. A cell's id digests everything its responses depend on, so a rerun finds the cells
it already has."""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from rolemrc.core.artifacts import expect
from rolemrc.core.extras import require
from rolemrc.core.openai_client import ROLEMRC_KEY_ENV
from rolemrc.core.placement import Dtype, check_dtype
from rolemrc.intervene.budget import BUDGET_OPTIONS, GRID_ONE, Budget, budget_grid
from rolemrc.intervene.spec import PAPER_FACTOR, Restraint, RestraintError
from rolemrc.probe.options import Direction
from rolemrc.probe.selectors import SELECTORS
from rolemrc.sweep.sources import IN_PROCESS, check_engine

BASELINE = "baseline"
FACTORS = (PAPER_FACTOR, 0.99, 0.9, 0.5, 0.0)   # the default grid's scales
# the default grid's budgets, as shares of the MLP units: on SmolLM2 the calibration saw nothing move at 1% and 4%,
# and attribution x 0 undo a planted change at 17% (and break role style on a smaller organism): docs/calibration.md
SHARES = (0.01, 0.05, 0.17)
# random-unit controls per cell: one control cannot place a cell (two of one size undid 44% and 64% of a planted change)
CONTROLS = 10
# restraint kinds a sweep's grid applies: to its selected units and their controls (scale, patch), or a direction per
# layer in the budget's top layers against random unit directions there; all of them side by side, reverts included,
# against controls of their own kind: `sweep frontier`
SWEEP_KINDS = ("scale", "patch", "direction")
TOP_LAYERS = (1, 2, 4)   # a direction's default budgets: the N layers where the difference of means is longest
NO_REVERT = ("--kind revert: a revert has no runtime hook, so a sweep cannot generate it beside its other cells (each "
             "would need the weights baked in memory for a pass of its own); `rolemrc sweep frontier` measures unit, "
             "layer and model reverts against random controls of their own kind")
# how a cell is scored: judge: its generated replies by the judge and metrics; kl: one teacher-forced forward pass per
# case, its KL to the base (SFT) model as a share of the DPO model's undone (`sweep.kl`)
Measure = Literal["judge", "kl"]
MEASURES: tuple[str, ...] = get_args(Measure)


@dataclass
class SweepConfig:
    """What a sweep runs: the grid, its controls, and how each cell generates."""

    model: str
    diff: str
    data: str
    out: str
    dimensions: list[str]
    method: str | None             # the unit selector (probe.selectors.SELECTORS), named; `diff` is its input (None for
    # a direction, the diff's difference of means)
    kind: str = "scale"            # what a cell does (SWEEP_KINDS): scale its units by its factor, patch them, or project
    # a direction out
    means: str | None = None       # patch: a diff whose A side's mean activations the units are set to (default: diff)
    cells_dir: str | None = None   # where generated cells are kept (default OUT/cells); sweeps may share one
    factors: list[float] = field(default_factory=lambda: list(FACTORS))
    # the budgets, at most one of (intervene.budget): global counts, units from each layer, shares of all units
    top_k: list[int] | None = None
    per_layer: list[int] | None = None
    share: list[float] | None = None
    top_layers: list[int] | None = None   # a direction's budgets (default TOP_LAYERS)
    direction: Direction = "both"
    layers: str | None = None
    controls: int = CONTROLS
    magnitudes: str | None = None  # a diff whose activation moments match the controls (default: `diff`, if a diff)
    seed: int = 0
    max_new_tokens: int = 96
    batch_size: int = 32
    cells_per_pass: int = 4        # cells generated together (sharing batches); each pass is saved when done
    engine: str = "transformers"   # a serve engine: transformers runs in this process; others (vllm) in a rolemrc server
    base_url: str | None = None    # instead: any OpenAI-compatible rolemrc endpoint serving `model`'s weights
    served_model: str | None = None   # its model id (default: the one unrestrained model it lists)
    api_key_env: str = ROLEMRC_KEY_ENV   # the endpoint's key (one of the rolemrc server's keys)
    concurrency: int = 16          # requests in flight (endpoint engines)
    engine_options: dict[str, Any] = field(default_factory=dict)   # more of the engine's serve options (vLLM's
    # memory_utilization, vllm_args, dtype, ...), not those the sweep sizes itself (sources.SWEEP_SETS)
    judge: str = "rules"           # a judge of eval's registry (eval.judges.JUDGES)
    judge_model: str | None = None     # endpoint judges: the judge model and its OpenAI-compatible base URL
    judge_base_url: str | None = None
    measure: Measure = "judge"
    base: str | None = None        # kl: the SFT model `model` was trained from by DPO, the one KL is taken to
    continuation: str = "sft"      # kl: the text scored after each prompt (eval.generate.Continuation)
    neutral: str | None = None     # kl: plain text, a passage per line: each cell's perplexity on it
    strict: bool = False           # refuse restraints selected on another model than `model` (default: a warning)
    limit: int | None = None       # use only the first `limit` cases of `data` (part of each cell's identity)
    dtype: Dtype = "auto"          # the in-process model's dtype (auto: the checkpoint's own)
    device: str = "auto"           # and its device (auto: a GPU when there is one)

    def __post_init__(self) -> None:
        if not self.dimensions:
            raise RestraintError("a sweep needs at least one dimension")
        if self.controls < 0:
            raise RestraintError(f"controls must be >= 0, got {self.controls}")
        if self.cells_per_pass < 1:
            raise RestraintError(f"cells_per_pass must be >= 1, got {self.cells_per_pass}")
        if not self.factors:
            raise RestraintError("a sweep needs at least one factor")
        self.check_kind()
        self.budgets()
        check_dtype(self.dtype)
        if self.base_url and self.engine != IN_PROCESS:
            raise RestraintError(f"--base-url generates on a running server; --engine {self.engine} starts one: choose one")
        check_engine(self.engine, self.engine_options)
        require("eval", what="a sweep")
        if self.engine != IN_PROCESS and not self.base_url:
            require("serve", what=f"a sweep on the {self.engine} engine (a rolemrc server)")
        if self.measure not in MEASURES:
            raise RestraintError(f"--measure: one of {', '.join(MEASURES)}, not {self.measure!r}")
        if self.measure == "kl":
            self.check_kl()
        elif self.base or self.neutral:
            raise RestraintError("--base and --neutral are --measure kl's; the judge measure scores generated replies")
        else:
            self.judge_config()

    def check_kind(self) -> None:
        """The kind, and the settings that belong to it: a patch and a direction have no factor (--factors 0), a
        direction no unit selector, controls matched on magnitudes, nor unit budgets."""
        if self.kind == "revert":
            raise RestraintError(NO_REVERT)
        if self.kind not in SWEEP_KINDS:
            raise RestraintError(f"--kind: one of {', '.join(SWEEP_KINDS)}, not {self.kind!r} (every kind against "
                                 "controls of its own: `rolemrc sweep frontier`)")
        if self.kind != "scale" and self.factors != [0.0]:
            does = "sets its units to the SFT mean" if self.kind == "patch" else "projects its direction out"
            raise RestraintError(f"--kind {self.kind} {does}, a factor-less restraint: --factors 0")
        if self.means and self.kind != "patch":
            raise RestraintError("--means is --kind patch's")
        if self.kind == "direction":
            given = [o for o, v in (("--method", self.method), ("--magnitudes", self.magnitudes)) if v is not None]
            if given:
                raise RestraintError(f"--kind direction takes the diff's difference of means in its top layers, against "
                                     f"random unit directions: {' and '.join(given)} select or match units")
        elif self.method is None:
            raise RestraintError(f"--kind {self.kind} needs --method, the unit selector")
        else:
            SELECTORS.check([self.method])

    def check_kl(self) -> None:
        """--measure kl's inputs: the base model and the neutral texts readable, the cells run in this process."""
        from rolemrc.core.modeling import resolve_model
        from rolemrc.eval.generate import CONTINUATIONS

        if self.base is None:
            raise RestraintError("--measure kl needs --base, the SFT model the DPO --model was trained from")
        if self.base_url or self.engine != IN_PROCESS:
            raise RestraintError(f"--measure kl runs its forward passes in this process (--engine {IN_PROCESS}, no "
                                 "--base-url)")
        if self.continuation not in CONTINUATIONS:
            raise RestraintError(f"--continuation: one of {', '.join(CONTINUATIONS)}, not {self.continuation!r}")
        resolve_model(self.base)
        if self.neutral:
            neutral_texts(self.neutral)

    def budgets(self) -> list[Budget]:
        """The grid's budgets: a direction's top_layers (default TOP_LAYERS); else the top_k, per_layer or share list
        given, else SHARES."""
        units = {"top_k": self.top_k, "per_layer": self.per_layer, "share": self.share}
        if self.kind == "direction":
            given = [BUDGET_OPTIONS[k] for k, v in units.items() if v is not None]
            if given:
                raise RestraintError(f"--kind direction's budgets are --top-layers, not {', '.join(given)}")
            return [Budget("top_layers", n) for n in self.top_layers or TOP_LAYERS]
        if self.top_layers is not None:
            raise RestraintError(f"--top-layers is --kind direction's; --kind {self.kind} takes {GRID_ONE}")
        return budget_grid([Budget("share", s) for s in SHARES], **units)

    def judge_config(self) -> Any:
        """The `eval.judges.JudgeConfig` scoring every cell (an unknown or misconfigured judge is an error)."""
        from rolemrc.eval.judges import JudgeConfig

        return JudgeConfig(name=self.judge, model=self.judge_model, base_url=self.judge_base_url)


def neutral_texts(path: str) -> list[str]:
    """The passages of a --neutral file: its non-empty lines."""
    expect(path, "text", "--neutral wants plain text, a passage per line")
    lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise RestraintError(f"{path}: no text in it (--neutral wants plain text, a passage per line)")
    return lines


def numbers(text: str, what: str) -> list[float]:
    """'0.5,0' -> [0.5, 0.0]; anything else is a RestraintError naming the option."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise RestraintError(f"{what}: comma-separated numbers, got {text!r}") from None


@dataclass(frozen=True)
class Cell:
    """One generation pass: the baseline (no restraint), a grid cell's selected units, or one of its controls."""

    id: str
    kind: str                      # baseline | selected | control (| continuation: --measure kl's texts, stored)
    grid: dict[str, Any]           # dimension, factor, budget ({kind: value}) of the grid cell ({} for the baseline)
    restraint: Restraint | None
    draw: int | None = None        # control index

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "grid": self.grid, "draw": self.draw,
                "restraint": self.restraint.to_dict() if self.restraint else None}


def cell_id(kind: str, restraint: Restraint | None, settings: dict[str, Any]) -> str:
    """A name that changes whenever anything the cell's responses depend on changes."""
    what = {k: v for k, v in restraint.to_dict().items() if k != "model"} if restraint else None   # not what it does
    key = json.dumps({"restraint": what, **settings}, sort_keys=True, default=str)
    return f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def plan(config: SweepConfig, width: int, settings: dict[str, Any]) -> list[Cell]:
    """The baseline, then per grid cell its restraint and `config.controls` controls of its kind: units selected and
    random units matched on activation magnitude (`sweep.controls`), or a direction and random unit directions in its
    layers. `width`: units at the diff's hook point; `settings`: what else responses depend on (model, data,
    generation). A direction budget that reaches no further layer than the one before it is left out."""
    from rolemrc.intervene.select import warnings_once

    cells = [Cell(cell_id(BASELINE, None, settings), BASELINE, {}, None)]
    magnitudes: dict[str, tuple[Any, str]] = {}   # dimension -> unit magnitudes and what they are
    reached: dict[str, list[int]] = {}   # dimension -> the layers of its last direction cell
    with warnings_once():   # one paper-factor or frequency note for the whole grid
        for dimension, budget, factor in itertools.product(config.dimensions, config.budgets(), config.factors):
            grid = {"dimension": dimension, "factor": factor, "budget": budget.to_dict()}
            name = f"{dimension.replace('_', '-')}-{budget.slug}-x{factor:g}"
            if config.kind == "direction":
                restraint, controls = direction_cell(config, dimension, budget, name)
                if reached.get(dimension) == restraint.sites:   # fewer layers differ than the budget names
                    continue
                reached[dimension] = restraint.sites
            else:
                restraint, controls = unit_cell(config, dimension, budget, factor, name, width, magnitudes)
            cells.append(Cell(cell_id("selected", restraint, settings), "selected", grid, restraint))
            cells += [Cell(cell_id("control", c, settings), "control", grid, c, draw=k) for k, c in enumerate(controls)]
    return cells


def unit_cell(config: SweepConfig, dimension: str, budget: Budget, factor: float, name: str, width: int,
              magnitudes: dict[str, tuple[Any, str]]) -> tuple[Restraint, list[Restraint]]:
    """The selected units (scaled by `factor`, or patched to the SFT mean) and their controls matched on activation
    magnitude (read once per dimension into `magnitudes`)."""
    from rolemrc.intervene.kinds import as_patch
    from rolemrc.intervene.select import select
    from rolemrc.sweep.controls import draw_controls, unit_magnitudes

    def of_kind(r: Restraint) -> Restraint:
        return as_patch(r, config.means or config.diff, dimension) if config.kind == "patch" else r

    chosen = select(config.diff, dimension, method=config.method, layers=config.layers, direction=config.direction,
                    factor=factor, name=name, **budget.to_dict())
    restraint = of_kind(chosen)
    if dimension not in magnitudes:   # read after the selection, which checks the input first
        magnitudes[dimension] = unit_magnitudes(config.magnitudes or config.diff, dimension)
    magnitude, how = magnitudes[dimension]
    drawn = draw_controls(chosen, width, config.controls, seed=config.seed, magnitude=magnitude, how=how)
    return restraint, [of_kind(c) for c in drawn]


def direction_cell(config: SweepConfig, dimension: str, budget: Budget, name: str) -> tuple[Restraint, list[Restraint]]:
    """The diff's difference of means (DPO - SFT) on `dimension` in the budget's top layers, and random unit
    directions in the same layers."""
    from rolemrc.intervene.kinds import direction_restraint
    from rolemrc.sweep.controls import random_directions

    restraint = direction_restraint(config.diff, dimension, layers=config.layers, top_layers=budget.value, name=name)
    return restraint, random_directions(restraint, config.controls, config.seed)
