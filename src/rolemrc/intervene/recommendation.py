"""The calibration's recommendation as `intervene select --calibration` reads it: the selector, budget and factor a
calibration (`rolemrc organism calibrate`, which writes it into calibration.json under RECOMMENDATION) found to undo
a planted change, or why it found none. The format lives here, below organism, so that select can read it."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rolemrc.core.artifacts import expect
from rolemrc.intervene.budget import Budget
from rolemrc.intervene.spec import RestraintError

RECOMMENDATION = "recommendation"   # its key in calibration.json
STATUSES = ("found", "none", "unstable")
CALIBRATION_FILE = "calibration.json"


@dataclass
class Recommendation:
    """status: found (a recipe undoes every planted change without breaking another dimension, leaves the null
    organism alone, and every other calibration it was checked against agrees), none (no cell undoes a planted
    change), unstable (one does, but fails one of those checks); why: one sentence with every reason.
    selector, budget (as the calibration ran it), per_layer (min/median/max units per layer of the cell), share (of
    all units at the hook point), factor: the cell's recipe (None unless found or unstable). rests_on: the settings
    the evidence comes from (probe cases, attribution pairs, held-out cases, DPO steps, seeds); holds_over: the
    settings of every calibration where the recipe held (this one first), fails_over: those where it did not, each
    with its folder and why."""

    status: str
    why: str
    selector: str | None = None
    budget: dict[str, float] | None = None
    per_layer: dict[str, float] | None = None
    share: float | None = None
    factor: float | None = None
    rests_on: dict[str, Any] = field(default_factory=dict)
    holds_over: list[dict[str, Any]] = field(default_factory=list)
    fails_over: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise RestraintError(f"a recommendation's status is one of {', '.join(STATUSES)}, not {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def recipe(self) -> tuple[str, Budget, float]:
        """(selector, budget, factor) when the calibration found one; a RestraintError saying what it found otherwise."""
        if self.status != "found" or self.selector is None or not self.budget or self.factor is None:
            raise RestraintError(f"the calibration found no recipe to use ({self.status}: {self.why}); name --method "
                                 "and --factor yourself (docs/calibration.md)")
        return self.selector, Budget.of(self.budget), self.factor


def load_recommendation(path: str | os.PathLike) -> Recommendation:
    """The recommendation of a calibration folder (or its calibration.json)."""
    path = expect(path, ("calibration", "json"), "--calibration wants a calibration folder (from `rolemrc organism "
                  "calibrate`) or its calibration.json")
    file = path / CALIBRATION_FILE if path.is_dir() else path
    try:
        data = json.loads(Path(file).read_text())
    except (OSError, ValueError) as exc:
        raise RestraintError(f"{file}: cannot read it as a calibration ({exc})") from None
    found = data.get(RECOMMENDATION) if isinstance(data, dict) else None
    if not isinstance(found, dict):
        raise RestraintError(f"{file}: no {RECOMMENDATION!r} in it (not a calibration, or one written before rolemrc "
                             "recommended: rerun `rolemrc organism calibrate`, which reuses its stages)")
    try:
        return Recommendation(**found)
    except TypeError as exc:
        raise RestraintError(f"{file}: a malformed recommendation ({exc})") from None
