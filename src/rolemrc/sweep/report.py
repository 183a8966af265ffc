"""sweep.json and sweep.md: one row per grid cell (its footprint and, per score, the effect against the baseline
and against its controls with 95% CIs and Holm-corrected p, and its place among the controls), under one sentence
saying which cells, if any, beat both and at what cost in metrics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from rolemrc.intervene.budget import Budget, coverage_text
from rolemrc.sweep.stats import COMPARISONS, LOWER_IS_BETTER, MEASURE_SCORES, Scores, is_primary

ALPHA = 0.05
# a cell's controls: random units (scale, patch) or, for a direction, random directions
CONTROLS_TEXT = ("same units per layer, same factor, matched on activation magnitude",
                 "a random unit direction in each of the same layers")
# what a cell beats the baseline and its controls on, per measure
PRIMARY_WORDS = {"judge": "a judge dimension", "kl": "a dimension's restoration (KL to the base model)"}


def sweep_summary(config: Any, selected: list, effects: dict[str, dict], prints: dict[str, dict],
                  baseline: Scores) -> dict:
    base = {name: sum(v.values()) / len(v) for name, v in baseline.items() if v}
    cells = [{"id": c.id, **c.grid, **prints[c.id], "coverage": c.restraint.source.get("coverage"),
              **({"layers": c.restraint.sites} if c.restraint.kind == "direction" else {}), "scores": effects[c.id]}
             for c in selected]
    return {"config": asdict(config), "alpha": ALPHA, "baseline": base, "cells": cells,
            "headline": headline(cells, config.measure)}


def wins(cell: dict, family: str, sign: int) -> list[str]:
    """Scores where the cell differs in direction `sign` under `family` at Holm-corrected p < ALPHA."""
    return [name for name, e in cell["scores"].items()
            if family in e and e[family]["p_holm"] < ALPHA and sign * e[family]["diff"] > 0]


def cell_label(cell: dict) -> str:
    """'role_style 16/layer x0', 'role_style top-64 x0.5', 'role_style share 0.17 x0'."""
    return f"{cell['dimension']} {Budget.of(cell['budget']).label} x{cell['factor']:g}"


def beats_both(cell: dict) -> list[str]:
    """The primary scores (judge pass shares or restorations) on which the cell is significantly better than both its
    baseline and its controls."""
    return [n for n in wins(cell, "vs_baseline", 1) if is_primary(n) and n in wins(cell, "vs_controls", 1)]


def costs(cell: dict) -> list[str]:
    """The other scores (metrics, neutral perplexity) on which the cell is significantly worse than the baseline."""
    return [n for n in cell["scores"] if not is_primary(n)
            and n in wins(cell, "vs_baseline", 1 if n in LOWER_IS_BETTER else -1)]


def rank_cells(cells: list[dict]) -> list[dict]:
    """Best first: more primary scores beating both, then the larger mean lower 95% bound of the primary effects
    against the controls (a cell whose effect the controls match ranks low)."""
    def bound(cell: dict) -> float:
        lows = [e["vs_controls"]["lo"] for n, e in cell["scores"].items() if is_primary(n) and "vs_controls" in e]
        return sum(lows) / len(lows) if lows else float("-inf")

    return sorted(cells, key=lambda c: (-len(beats_both(c)), -bound(c)))


def headline(cells: list[dict], measure: str = "judge") -> str:
    """Which cells beat both the baseline and their controls on a primary score of `measure`, and what that costs."""
    tests = sum(len(c["scores"]) for c in cells)
    prefix, what = MEASURE_SCORES[measure][0], PRIMARY_WORDS[measure]
    winners = []
    for cell in cells:
        better = beats_both(cell)
        if better:
            winners.append(f"{cell_label(cell)} ({', '.join(n.removeprefix(prefix) for n in better)}; "
                           f"cost: {', '.join(costs(cell)) or 'no metric significantly worse'})")
    moved = [c for c in cells if wins(c, "vs_baseline", 1) or wins(c, "vs_baseline", -1)]
    if winners:
        return (f"{len(winners)} of {len(cells)} cells beat both the baseline and their random-unit controls on {what} "
                f"(Holm over {tests} tests per family, p < {ALPHA}): {'; '.join(winners)}.")
    return (f"No cell beats both the baseline and its random-unit controls on {what.replace('a ', 'any ', 1)} (Holm "
            f"over {tests} tests per family, p < {ALPHA}); {len(moved)} of {len(cells)} cells differ from the baseline "
            "on some score.")


def effect_text(entry: dict | None, family: str) -> str:
    if not entry or family not in entry:
        return "–"
    t = entry[family]
    mark = " *" if t["p_holm"] < ALPHA else ""
    return f"{t['diff']:+.3f} [{t['lo']:+.3f}, {t['hi']:+.3f}] p={t['p_holm']:.2g}{mark}"


def placement_text(entry: dict | None) -> str:
    """'p100 of 10, +0.250 [+0.180, +0.320]': the cell's percentile among its controls, the gap to their median."""
    if not entry or "placement" not in entry:
        return "–"
    t = entry["placement"]
    return f"p{t['percentile']:.0f} of {t['k']}, {t['gap']:+.3f} [{t['lo']:+.3f}, {t['hi']:+.3f}]"


def score_table(cells: list[dict], names: list[str], text: Callable[[dict | None], str]) -> list[str]:
    """A markdown table: a row per cell, a column per score, each entry `text(cell's entry for that score)`."""
    return (["| cell | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
            + [f"| {cell_label(c)} | " + " | ".join(text(c["scores"].get(n)) for n in names) + " |" for c in cells])


def divergence_text(summary: dict) -> list[str]:
    """--measure kl: what a restoration is a share of, the DPO model's KL to the base model per dimension."""
    if summary["config"]["measure"] != "kl":
        return []
    per = ", ".join(f"{d} {v:.4g}" for d, v in summary["kl_to_base"].items())
    return [f"Restoration: 1 − KL(cell ‖ base) / KL(DPO ‖ base) on a dimension's cases, each case teacher-forced on "
            f"the {summary['config']['continuation']} continuation; the DPO model's mean KL per token: {per}.", ""]


def reach_text(cell: dict) -> str:
    """What a cell restrains: its units (`coverage_text`), or a direction's layers."""
    return coverage_text(cell["coverage"]) if cell["coverage"] else f"a direction in layers {cell['layers']}"


def elements_text(changed: int | None) -> str:
    return "no bake" if changed is None else str(changed)   # None: the kind does not fold into weights there


def sweep_markdown(summary: dict) -> str:
    cells = summary["cells"]
    names = sorted({n for c in cells for n in c["scores"]}, key=lambda n: (not is_primary(n), n))
    lines = ["# Restraint sweep", "", summary["headline"], "", *divergence_text(summary),
             "Effects are paired per item: the cell minus the baseline, and the cell minus the mean of its random "
             f"controls ({CONTROLS_TEXT[summary['config']['kind'] == 'direction']}). Mean [95% bootstrap CI], "
             f"Holm-corrected p over the grid; * marks p < {summary['alpha']}.", "",
             "| cell | units (share of all; per layer) | weight elements | max Δlogit |", "|---|---|---|---|"]
    lines += [f"| {cell_label(c)} | {reach_text(c)} | {elements_text(c['weight_elements_changed'])} | "
              f"{c['max_logit_shift']:.3g} |" for c in cells]
    for family, title in COMPARISONS.items():
        lines += ["", f"## Effect {title}", "", *score_table(cells, names, lambda e, f=family: effect_text(e, f))]
    lines += ["", "## Place among the controls", "",
              "The cell's percentile among its controls' means (50: like a typical control; 0 or 100: beyond every "
              "one), and its gap to their median [95% bootstrap CI over cases and controls].", "",
              *score_table(cells, names, placement_text)]
    return "\n".join(lines) + "\n"
