"""How many units a selection takes (a `Budget`), the one rule that exactly one way is named, and what a selection
covers (units per layer, share of all units) as every report states it. Imports no torch (the CLI's help reads it).

- top_k: the first K units ranked over all selected layers (a global count);
- per_layer: exactly K from each selected layer, ranked within the layer;
- share: round(S x all units of the selected layers), ranked over them (0 < S <= 1);
- fdr: every unit with BH q below Q (selectors with a test only);
- top_layers: a direction's, not a selection's: the N layers where the difference of means is longest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rolemrc.intervene.spec import RestraintError

BUDGET_OPTIONS = {"top_k": "--top-k", "per_layer": "--per-layer", "share": "--share", "fdr": "--fdr"}
BUDGET_KINDS = {**BUDGET_OPTIONS, "top_layers": "--top-layers"}   # with a direction's (sweep run --kind direction)
EXACTLY_ONE = "exactly one of " + "/".join(BUDGET_OPTIONS.values())
BUDGET_HELP = {
    "top_k": f"the K highest-ranked units over all selected layers ({EXACTLY_ONE})",
    "per_layer": f"exactly K units from each selected layer, ranked within the layer ({EXACTLY_ONE})",
    "share": f"round(S x all units of the selected layers), ranked over them; 0 < S <= 1 ({EXACTLY_ONE})",
    "fdr": f"every unit with BH q below Q, selectors with a test only ({EXACTLY_ONE})",
}


@dataclass(frozen=True)
class Budget:
    """One way of saying how many units (or, for a direction, layers): `kind` (a key of BUDGET_KINDS) and its value."""

    kind: str
    value: float

    def __post_init__(self) -> None:
        option = BUDGET_KINDS.get(self.kind)
        if option is None:
            raise RestraintError(f"a budget is one of {', '.join(BUDGET_KINDS)}, not {self.kind!r}")
        whole = self.kind in ("top_k", "per_layer", "top_layers")
        if whole and (self.value != int(self.value) or self.value < 1):
            raise RestraintError(f"{option} must be a whole number >= 1, got {self.value:g}")
        if self.kind in ("share", "fdr") and not 0 < self.value <= 1:
            raise RestraintError(f"{option} must be in (0, 1], got {self.value:g}")
        if whole:
            object.__setattr__(self, "value", int(self.value))

    @property
    def label(self) -> str:
        """Short and unambiguous: 'top-64', '16/layer', 'share 0.17', 'q < 0.05', '4 layers'."""
        return {"top_k": f"top-{self.value}", "per_layer": f"{self.value}/layer", "share": f"share {self.value:.3g}",
                "fdr": f"q < {self.value:g}", "top_layers": f"{self.value} layers"}[self.kind]

    @property
    def slug(self) -> str:
        """For names: 'k64', '16pl', 's0.17', 'q0.05', '4l'."""
        return {"top_k": f"k{self.value}", "per_layer": f"{self.value}pl", "share": f"s{self.value:.3g}",
                "fdr": f"q{self.value:g}", "top_layers": f"{self.value}l"}[self.kind]

    def to_dict(self) -> dict[str, float]:
        return {self.kind: self.value}

    @classmethod
    def of(cls, data: dict[str, float]) -> Budget:
        """The budget of a `to_dict()` mapping (a sweep cell's `budget`)."""
        if not isinstance(data, dict) or len(data) != 1:
            raise RestraintError(f"a budget is one {{kind: value}}, got {data!r}")
        return cls(*next(iter(data.items())))


def one_budget(**given: float | None) -> Budget:
    """The one budget among keyword arguments named as BUDGET_OPTIONS' keys (the others None); a RestraintError
    naming the options otherwise."""
    named = {k: v for k, v in given.items() if v is not None}
    if len(named) != 1:
        said = ", ".join(BUDGET_OPTIONS[k] for k in named) or "none"
        raise RestraintError(f"choose {EXACTLY_ONE} (given: {said})")
    return Budget(*next(iter(named.items())))


GRID_ONE = "at most one of --top-k/--per-layer/--share"
# units per layer of the recovery curve (the share of a planted change undone against units: organism calibrate's
# default grid; its first three are the budgets whose stability probe diff reports): on SmolLM2's 1,536-wide MLP 1%,
# 4%, 17% and 67% of the units
CURVE = (16, 64, 256, 1024)


def budget_grid(default: list[Budget], **given: list[float] | None) -> list[Budget]:
    """A grid's budgets: the list under the one of top_k/per_layer/share that is given, else `default`."""
    named = {k: v for k, v in given.items() if v is not None}
    if len(named) > 1:
        raise RestraintError(f"choose {GRID_ONE} (given: {', '.join(BUDGET_OPTIONS[k] for k in named)})")
    if not named:
        return default
    kind, values = next(iter(named.items()))
    if not values:
        raise RestraintError(f"{BUDGET_OPTIONS[kind]} needs at least one value")
    return [Budget(kind, v) for v in values]


def coverage(per_layer: list[int], width: int, layers: int) -> dict[str, Any]:
    """What a selection covers, from its unit count per selected layer (layers without units count 0): units, units
    per layer (min, median, max; the list where there are at most 8 layers) and the share of all `layers` x `width`
    units at the hook point."""
    counts = sorted(per_layer)
    n = len(counts)
    median = (counts[(n - 1) // 2] + counts[n // 2]) / 2
    out: dict[str, Any] = {"units": sum(counts), "share": sum(counts) / (layers * width), "of": layers * width,
                           "per_layer": {"min": counts[0], "median": median, "max": counts[-1]}}
    if n <= 8:
        out["per_layer"]["list"] = list(per_layer)
    return out


def coverage_text(c: dict[str, Any]) -> str:
    """'7,680 units (16.7% of 46,080): 256 per layer' or '... per layer min 3, median 250, max 900'."""
    p = c["per_layer"]
    spread = (f"{p['min']} per layer" if p["min"] == p["max"] else
              f"per layer {p['list']}" if "list" in p else f"per layer min {p['min']}, median {p['median']:g}, max {p['max']}")
    return f"{c['units']:,} units ({100 * c['share']:.3g}% of {c['of']:,}): {spread}"
