"""What calibration runs: the organisms it reads and the grid of selectors x unit budgets x factors."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolemrc.intervene.budget import CURVE, Budget, budget_grid
from rolemrc.intervene.spec import PAPER_FACTOR
from rolemrc.probe.selectors import SELECTORS
from rolemrc.sweep.plan import CONTROLS, MEASURES, Measure

ALPHA = 0.05   # the significance level of every test and flag
# the default budgets: intervene.budget.CURVE per layer, those below a model's width. Yang et al. (arXiv 2411.06424)
# find ablating the "toxic" neurons explains 2.5-24% of DPO's effect, the curve's reference.
YANG_RANGE = (0.025, 0.24)   # Yang et al.'s share of DPO's effect explained by ablating the units it changed


@dataclass
class Organism:
    """What calibration needs of an organism: its two models, the pairs DPO trained on, the held-out cases with the
    SFT model's eval run on them, the probe cases (never trained on) and the dimension it changes (None: the null,
    which changes none)."""

    kind: str
    sft: str
    dpo: str
    pairs: str
    heldout: str
    sft_eval: str
    probe: str
    dimension: str | None
    settings: dict[str, Any] = field(default_factory=dict)   # how it was built (`OrganismConfig.settings`)
    known_units: dict[str, list[int]] | None = None   # the units organism's S (layer -> units), where the change lives
    headline: str = ""   # its build's verdict on its target (organism.json)
    meets_target: bool = True

    @classmethod
    def from_report(cls, report: dict[str, Any], probe: str | Path) -> Organism:
        return cls(report["kind"], report["sft"], report["dpo"], report["pairs"], report["heldout"],
                   report["sft_eval"], str(probe), report["planted_dimension"], report.get("settings", {}),
                   report.get("known_units"), report.get("headline", ""), report.get("meets_target", True))


@dataclass
class CalibrationConfig:
    """The grid and its costs. Budgets as `sweep run`'s (`intervene.budget`): at most one of top_k, per_layer,
    share, default per_layer CURVE."""

    out: str
    selectors: list[str] = field(default_factory=lambda: list(SELECTORS.names()))   # probe.selectors' table
    top_k: list[int] | None = None
    per_layer: list[int] | None = None
    share: list[float] | None = None
    # 0.5 undid nothing anywhere on SmolLM2 (docs/calibration.md), so the curve is drawn at 0 alone
    factors: list[float] = field(default_factory=lambda: [0.0])
    # the paper's near-identity factor 1 - 1e-6 as its own sweep, at the largest budget only: its effect can only grow
    # with the units it scales, so the largest budget is where it would show
    paper_factor: bool = True
    controls: int = CONTROLS          # random-unit controls per cell, as a sweep's
    attribution_pairs: int = 16       # organism pairs (of the planted dimension first) attribution runs over
    max_new_tokens: int = 32          # as the organisms' held-out eval, so the SFT run is comparable
    batch_size: int = 32              # rows per generation batch (the sweep's cells share batches)
    hook: str = "mlp.act"
    seed: int = 0
    # how a cell is scored (the sweep's --measure): kl, the share of the DPO model's KL to the SFT model it undoes on
    # the SFT model's own replies (forward passes); judge, the rules judge's verdicts on its generated replies
    measure: Measure = "kl"
    # every restraint kind on each planted organism's pair (`sweep.frontier`), at the grid's per-layer budgets; on a
    # units organism with the ceiling of its known units
    frontier: bool = False

    def __post_init__(self) -> None:
        from rolemrc.core.errors import InputError
        from rolemrc.core.hooks import check_point

        check_point(self.hook)
        SELECTORS.check(self.selectors)
        if self.measure not in MEASURES:
            raise InputError(f"--measure: one of {', '.join(MEASURES)}, not {self.measure!r}")
        self.budgets()

    def check_fits(self, width: int, layers: int, model: str) -> None:
        """Refuse a budget given (not the default curve, which keeps what fits) that `model`'s hook point cannot
        take: --per-layer at or above its `width` units per layer, --top-k above its `layers` x `width` units."""
        from rolemrc.organism.config import OrganismError

        wide = [int(v) for v in self.per_layer or [] if v >= width]
        many = [int(v) for v in self.top_k or [] if v > layers * width]
        if wide:
            raise OrganismError(f"--per-layer {','.join(map(str, wide))}: {model} has {width} units per layer at "
                                f"{self.hook}; give values below {width}")
        if many:
            raise OrganismError(f"--top-k {','.join(map(str, many))}: {model} has {layers * width} units at {self.hook} "
                                f"({layers} layers x {width})")

    def budgets(self) -> list[Budget]:
        """The grid's budgets: the top_k, per_layer or share list given, else CURVE per layer."""
        return budget_grid([Budget("per_layer", k) for k in CURVE], top_k=self.top_k, per_layer=self.per_layer,
                           share=self.share)


def fitting(budgets: list[Budget], width: int) -> list[Budget]:
    """The budgets a model whose hook point is `width` units wide can take: per layer budgets below the width."""
    return [b for b in budgets if b.kind != "per_layer" or b.value < width]


def sweeps(config: CalibrationConfig, width: int) -> dict[str, tuple[list[Budget], list[float]]]:
    """A selector's sweeps, by folder suffix: budgets x factors, and the paper's factor at the largest budget."""
    budgets = fitting(config.budgets(), width)
    if not budgets:
        return {}
    grids = {"": (budgets, config.factors)}
    if config.paper_factor:
        grids["-paper"] = ([max(budgets, key=lambda b: b.value)], [PAPER_FACTOR])
    return {suffix: grid for suffix, grid in grids.items() if grid[1]}


# `--quick`: the paper's selector and attribution (the one that ranks units by their effect on the preference) at
# 256 units per layer (where attribution undid the narration change in the full grid), factor 0, no separate sweep
# of the paper's factor (it changed nothing in any full run), half the attribution pairs and probe cases.
QUICK_GRID = {"selectors": ["frequency", "attribution"], "per_layer": [256], "factors": [0.0], "attribution_pairs": 8,
              "paper_factor": False}
PROBE_CASES = 48
QUICK_PROBE_CASES = 24
# the organisms' settings of every calibration (`--quick` adds organism.config.QUICK): every planted case and 4 per other
# dimension (all 144 of datagen's small test set would triple the cost of every cell)
ORGANISM_SETTINGS = {"eval_others": 4}
