"""The sweep's statistics: per item scores of a cell (a judged cell's, or a teacher-forced one's: `sweep.kl`), each
grid cell's paired effect against the baseline and against its random-unit controls (difference in differences), its
placement among the controls, and Holm's correction over the grid."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from rolemrc.core.stats import control_placement, holm, mean_ci, paired_test
from rolemrc.eval.runs import EvalRun

JUDGE_PREFIX = "judge:"   # score names: "judge:<dimension>" (the item's pass share on it) or a metric name
RESTORATION_PREFIX = "restoration:"   # --measure kl: "restoration:<dimension>" (the case's share of it undone)
NEUTRAL_PPL = "neutral_ppl"   # --measure kl: a neutral text's perplexity
LOWER_IS_BETTER = (NEUTRAL_PPL,)
# per measure: the prefix of its primary scores (one per dimension) and what they are, in words
MEASURE_SCORES = {"judge": (JUDGE_PREFIX, "pass share"), "kl": (RESTORATION_PREFIX, "restoration")}
Scores = dict[str, dict[str, float]]   # score name -> {item id -> value}
# What each grid cell is compared with (paired per item), one Holm family each over the whole grid: key -> in words.
COMPARISONS = {"vs_baseline": "against the baseline", "vs_controls": "against the controls"}


def item_scores(run: EvalRun) -> Scores:
    """score name -> {item id -> value}: per judge dimension the share of the item's verdicts that pass, per
    reference metric its value."""
    passes: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for v in run.verdicts:
        if v.get("score") is not None:
            passes[JUDGE_PREFIX + v["dimension"]][v["id"]].append(float(v["score"]))
    scores = {name: {i: float(np.mean(vals)) for i, vals in by_item.items()} for name, by_item in passes.items()}
    for row in run.metrics:
        for name, value in row.items():
            if name != "id" and value is not None:
                scores.setdefault(name, {})[row["id"]] = float(value)
    return scores


def is_primary(name: str) -> bool:
    """Whether a score is a dimension's primary score (a judge pass share or a restoration), not a metric."""
    return name.startswith(tuple(prefix for prefix, _ in MEASURE_SCORES.values()))


def cell_effects(base: Scores, mine: Scores, ctrl: list[Scores], *, rounds: int = 10_000,
                 seed: int = 0) -> dict[str, dict[str, Any]]:
    """score -> {"mean", "lo", "hi", "vs_baseline", "controls_mean", "controls_lo", "controls_hi", "vs_controls",
    "placement"}: the cell's mean item score and that of its controls' per-item mean, each with a 95% bootstrap CI over
    the items (`mean_band`); paired tests (core.stats.paired_test) of the cell's item scores against the baseline's, and
    against the per-item mean of its controls', and where it falls among the controls (core.stats.control_placement),
    on the items all of them scored."""
    out = {}
    for name in sorted(set(base) & set(mine)):
        ids = sorted(set(base[name]) & set(mine[name]).intersection(*(c.get(name, {}) for c in ctrl)))
        if not ids:
            continue
        b = [base[name][i] for i in ids]
        m = [mine[name][i] for i in ids]
        entry = {"n": len(ids), **mean_band(m, rounds, seed), "vs_baseline": paired_test(b, m, rounds=rounds, seed=seed)}
        if ctrl:
            each = np.array([[scores[name][i] for i in ids] for scores in ctrl])
            entry |= {f"controls_{k}": v for k, v in mean_band(each.mean(0), rounds, seed).items()}
            entry["vs_controls"] = paired_test(each.mean(0), m, rounds=rounds, seed=seed)
            entry["placement"] = control_placement(m, each, rounds=rounds, seed=seed)
        out[name] = entry
    return out


def mean_band(values: Any, rounds: int, seed: int) -> dict[str, float]:
    """{"mean", "lo", "hi"}: the mean of per-item values and its 95% bootstrap percentile CI over the items."""
    ci = mean_ci(values, rounds=rounds, seed=seed)
    return {k: ci[k] for k in ("mean", "lo", "hi")}


def grid_effects(cells: list[Any], scores: dict[str, Scores]) -> dict[str, dict[str, Any]]:
    """selected cell id -> `cell_effects` against the baseline (`cells[0]`) and the controls of its grid cell."""
    return {c.id: cell_effects(scores[cells[0].id], scores[c.id],
                               [scores[k.id] for k in cells if k.kind == "control" and k.grid == c.grid])
            for c in cells if c.kind == "selected"}


def correct_grid(effects: dict[str, dict[str, dict[str, Any]]], family: int | None = None) -> None:
    """Add `p_holm` to every vs_baseline and every vs_controls test in `effects` (cell -> score -> entry), each
    comparison corrected over the whole grid (all cells x scores; `family`: the tests the grid declared, where some
    did not run)."""
    for comparison in COMPARISONS:
        tests = [e[comparison] for cell in effects.values() for e in cell.values() if comparison in e]
        for test, adjusted in zip(tests, holm([t["p"] for t in tests], family)):
            test["p_holm"] = adjusted
