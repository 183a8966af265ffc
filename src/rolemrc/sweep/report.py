"""sweep.json and sweep.md: one row per grid cell (its footprint and, per score, the effect against the baseline
and against its controls with 95% CIs and Holm-corrected p, and its place among the controls), under one sentence
saying which cells, if any, beat both and at what cost in metrics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from rolemrc.intervene.budget import Budget, coverage_text
from rolemrc.sweep.stats import COMPARISONS, JUDGE_PREFIX, item_scores

ALPHA = 0.05


def sweep_summary(config: Any, selected: list, effects: dict[str, dict], prints: dict[str, dict], baseline: Any) -> dict:
    base = {name: sum(v.values()) / len(v) for name, v in item_scores(baseline).items() if v}
    cells = [{"id": c.id, **c.grid, **prints[c.id], "coverage": c.restraint.source["coverage"], "scores": effects[c.id]}
             for c in selected]
    return {"config": asdict(config), "alpha": ALPHA, "baseline": base, "cells": cells, "headline": headline(cells)}


def _wins(cell: dict, family: str, sign: int) -> list[str]:
    """Scores where the cell differs in direction `sign` under `family` at Holm-corrected p < ALPHA."""
    return [name for name, e in cell["scores"].items()
            if family in e and e[family]["p_holm"] < ALPHA and sign * e[family]["diff"] > 0]


def cell_label(cell: dict) -> str:
    """'role_style 16/layer x0', 'role_style top-64 x0.5', 'role_style share 0.17 x0'."""
    return f"{cell['dimension']} {Budget.of(cell['budget']).label} x{cell['factor']:g}"


def beats_both(cell: dict) -> list[str]:
    """The judge scores on which the cell is significantly better than both its baseline and its controls."""
    return [n for n in _wins(cell, "vs_baseline", 1) if n.startswith(JUDGE_PREFIX) and n in _wins(cell, "vs_controls", 1)]


def rank_cells(cells: list[dict]) -> list[dict]:
    """Best first: more judge dimensions beating both, then the larger mean lower 95% bound of the judge effects
    against the controls (a cell whose effect the controls match ranks low)."""
    def bound(cell: dict) -> float:
        lows = [e["vs_controls"]["lo"] for n, e in cell["scores"].items() if n.startswith(JUDGE_PREFIX) and "vs_controls" in e]
        return sum(lows) / len(lows) if lows else float("-inf")

    return sorted(cells, key=lambda c: (-len(beats_both(c)), -bound(c)))


def headline(cells: list[dict]) -> str:
    """Which cells beat both the baseline and their controls on a judge dimension, and what that costs."""
    tests = sum(len(c["scores"]) for c in cells)
    winners = []
    for cell in cells:
        better = beats_both(cell)
        if better:
            costs = [n for n in _wins(cell, "vs_baseline", -1) if not n.startswith(JUDGE_PREFIX)]
            winners.append(f"{cell_label(cell)} ({', '.join(n.removeprefix(JUDGE_PREFIX) for n in better)}; "
                           f"cost: {', '.join(costs) or 'no metric significantly lower'})")
    moved = [c for c in cells if _wins(c, "vs_baseline", 1) or _wins(c, "vs_baseline", -1)]
    if winners:
        return (f"{len(winners)} of {len(cells)} cells beat both the baseline and their random-unit controls on a judge "
                f"dimension (Holm over {tests} tests per family, p < {ALPHA}): {'; '.join(winners)}.")
    return (f"No cell beats both the baseline and its random-unit controls on any judge dimension (Holm over {tests} "
            f"tests per family, p < {ALPHA}); {len(moved)} of {len(cells)} cells differ from the baseline on some score.")


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


def sweep_markdown(summary: dict) -> str:
    cells = summary["cells"]
    names = sorted({n for c in cells for n in c["scores"]}, key=lambda n: (not n.startswith(JUDGE_PREFIX), n))
    lines = ["# Restraint sweep", "", summary["headline"], "",
             "Effects are paired per item: the cell minus the baseline, and the cell minus the mean of its random-unit "
             "controls (same units per layer, same factor, matched on activation magnitude). Mean [95% bootstrap CI], "
             f"Holm-corrected p over the grid; * marks p < {summary['alpha']}.", "",
             "| cell | units (share of all; per layer) | weight elements | max Δlogit |", "|---|---|---|---|"]
    lines += [f"| {cell_label(c)} | {coverage_text(c['coverage'])} | {c['weight_elements_changed']} | "
              f"{c['max_logit_shift']:.3g} |" for c in cells]
    for family, title in COMPARISONS.items():
        lines += ["", f"## Effect {title}", "", *score_table(cells, names, lambda e, f=family: effect_text(e, f))]
    lines += ["", "## Place among the controls", "",
              "The cell's percentile among its controls' means (50: like a typical control; 0 or 100: beyond every "
              "one), and its gap to their median [95% bootstrap CI over cases and controls].", "",
              *score_table(cells, names, placement_text)]
    return "\n".join(lines) + "\n"
