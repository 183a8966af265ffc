"""A calibration over several seeds: each seed is a calibration of its own (its organisms' pairs, training order,
held-out and probe cases, and controls), and the recipe is chosen on the first seed and must hold on every other one
(the others are its confirmation: `recommend`'s `against`), so the recipe is not reported on the cases it was
chosen on. Rows keep their seed; the null's rates pool every seed's cells."""

from __future__ import annotations

import json
import math
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np

from rolemrc.core.io import write_json
from rolemrc.core.stats import t_interval
from rolemrc.intervene.recommendation import CALIBRATION_FILE, RECOMMENDATION
from rolemrc.organism.calibration_config import CalibrationConfig, Organism
from rolemrc.organism.calibration_report import calibration_figure, calibration_markdown, detection_figure, recovery
from rolemrc.organism.config import NULL
from rolemrc.organism.detection import detection_summary
from rolemrc.organism.recommend import recipe_of, recommend
from rolemrc.organism.scoring import finds_change, null_rates
from rolemrc.sweep.frontier import MATCH_POINTS, family_curves, interpolated


def combine_seeds(results: dict[int, dict[str, Any]], out: Path, against: list[dict[str, Any]]) -> dict[str, Any]:
    """One calibration of per-seed calibrations (`calibrate`'s results, by seed, each written under its own
    folder): the first seed's recommendation checked on every other seed and on `against`; writes
    calibration.json/.md and the figure under `out`."""
    first, *rest = results
    chosen = results[first]
    confirm = [{**results[s], "path": results[s]["config"]["out"]} for s in rest]
    organisms = [Organism(**o) for o in chosen["organisms"]]
    config = CalibrationConfig(**chosen["config"])
    rec = recommend(chosen["cells"], organisms, config, against + confirm, chosen["stability"],
                    selection=chosen.get("selection_cells") or None,
                    missed=[m["kind"] for m in chosen.get("missed_targets", [])]).to_dict()
    rows = [{**r, "seed": s} for s, result in results.items() for r in result["cells"]]
    over = over_seeds(rows, list(results))
    mine = [o for o in over if o["recipe"] == [rec.get("selector"), rec.get("budget"), rec.get("factor")]]
    if mine:
        rec["why"] += "".join(f"; over {o['seeds']} seeds {o['organism']} {_share(o)}, found in {o['found_in']}"
                              for o in mine)
    level = [o for o in mine if o["gap"]["lo"] is not None and not o["gap"]["lo"] > 0]
    if rec["status"] == "found" and level:   # every seed confirmed it, yet over seeds it may not beat its controls
        rec["status"] = "unstable"
        rec["why"] += "; but over seeds its lead over the controls' median is not above 0 for " + ", ".join(
            f"{o['organism']} ({o['gap']['mean']:+.0%}, 95% t-interval {o['gap']['lo']:+.0%} to {o['gap']['hi']:+.0%})"
            for o in level)
    result = {"config": {**chosen["config"], "out": str(out)}, "seeds": list(results), "selection_seed": first,
              "confirmation_seeds": rest, "organisms": [o for r in results.values() for o in r["organisms"]],
              "headline": " ".join(f"Seed {s}: {r['headline']}" for s, r in results.items()),
              RECOMMENDATION: rec, "over_seeds": over,
              "per_seed": {s: {"headline": r["headline"], RECOMMENDATION: r[RECOMMENDATION], "folder": r["config"]["out"]}
                           for s, r in results.items()},
              "recovery": [{**c, "seed": s} for s, r in results.items() for c in recovery(r["cells"])],
              "stability": [{**x, "seed": s} for s, r in results.items() for x in r["stability"]],
              "diff_flags": {f"{k}@{s}": v for s, r in results.items() for k, v in r["diff_flags"].items()},
              "detection": detection_summary([seed for r in results.values()
                                              for seed in _detections(r.get("detection", {}))]),
              "missed_targets": [m for r in results.values() for m in r.get("missed_targets", [])],
              "cells": rows, "skipped": {f"{k}@{s}": v for s, r in results.items() for k, v in r["skipped"].items()},
              "timing": {f"{k}@{s}": v for s, r in results.items() for k, v in r["timing"].items()},
              "frontiers": {f"{k}@{s}": f for s, r in results.items() for k, f in r.get("frontiers", {}).items()},
              "frontier_over_seeds": frontier_over_seeds(results),
              "frontier_leads_over_seeds": frontier_leads_over_seeds(results), **null_rates(rows)}
    out.mkdir(parents=True, exist_ok=True)
    result["figure"] = calibration_figure(rows, out) if rows else {}
    result["detection_figure"] = detection_figure(result["detection"], out) if result["detection"] else {}
    write_json(out / CALIBRATION_FILE, result)
    (out / "calibration.md").write_text(calibration_markdown(result))
    return json.loads(json.dumps(result, default=str))


def _detections(detection: dict[str, dict[str, Any]]) -> list[dict[str, dict[str, Any]]]:
    """One seed's calibration detection (`detection_summary` of that seed) as its per-seed `detect` mappings."""
    seeds = max((len(d["per_seed"]) for d in detection.values()), default=0)
    return [{k: d["per_seed"][i] for k, d in detection.items() if i < len(d["per_seed"])} for i in range(seeds)]


def over_seeds(rows: list[dict[str, Any]], seeds: list[int]) -> list[dict[str, Any]]:
    """Per recipe (selector, budget, factor) and planted organism, the verdict read at seed level: each seed's share
    undone, their mean with a Student-t 95% CI over seeds, the same for its lead over its controls' median (`gap`), and
    in how many seeds the cell found the change."""
    groups: dict[tuple, dict[int, dict[str, Any]]] = {}
    for r in rows:
        if r["organism"] != NULL:
            groups.setdefault((*recipe_of(r), r["organism"]), {})[r["seed"]] = r
    out = []
    for (selector, budget, factor, organism), by_seed in groups.items():
        shares = [by_seed[s]["restoration"]["share"] if s in by_seed else float("nan") for s in seeds]
        gaps = [lead(by_seed[s]) if s in by_seed else float("nan") for s in seeds]
        out.append({"recipe": [selector, json.loads(budget), factor], "organism": organism, "shares": shares,
                    **t_interval(shares), "gap": t_interval(gaps), "seeds": len(seeds),
                    "found_in": f"{sum(finds_change(r) for r in by_seed.values())} of {len(seeds)}"})
    return out


def frontier_over_seeds(results: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per organism and frontier point (family and setting) that every seed drew: its restoration, size and excess
    over its controls, each seed's and their mean with a Student-t 95% CI over seeds; and per organism, in how many
    seeds each family led at matched size (`leads`: the family that restores most at most matched sizes)."""
    keys = ("per_layer", "factor", "alpha", "top_layers")
    points: dict[tuple, dict[int, dict[str, Any]]] = {}
    leads: dict[str, dict[str, int]] = {}
    for seed, result in results.items():
        for kind, frontier in result.get("frontiers", {}).items():
            for p in frontier["points"]:
                points.setdefault((kind, p["family"], json.dumps({k: p[k] for k in keys if k in p})), {})[seed] = p
            leaders = [m["leader"] for m in frontier["matched"]]
            if leaders:
                top = max(set(leaders), key=leaders.count)
                leads.setdefault(kind, {})[top] = leads.get(kind, {}).get(top, 0) + 1
    out = []
    for (kind, family, setting), by_seed in points.items():
        if len(by_seed) < len(results):
            continue
        ps = [by_seed[s] for s in results]
        excess = [p["controls"]["excess"]["mean"] if "controls" in p else math.nan for p in ps]
        out.append({"organism": kind, "family": family, "setting": json.loads(setting), "seeds": len(ps),
                    "restoration": t_interval([p["restoration"]["mean"] for p in ps]),
                    "size": t_interval([p["size"]["mean"] for p in ps]), "excess": t_interval(excess),
                    "leads": leads.get(kind, {})})
    return out


def frontier_leads_over_seeds(results: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per organism and pair of families with a curve in every seed's frontier, at `MATCH_POINTS` sizes log-spaced over
    the range both curves reach in every seed: each seed's lead of one over the other (each curve's restoration
    interpolated in log size, as `sweep.frontier.matched` does per case) and their mean with a Student-t 95% CI over
    seeds (lo and hi None below two); `leader` is the family ahead on that mean. Each seed's bootstrap over its cases
    stays in its own frontier's `matched`."""
    seeds: dict[str, list[tuple[dict, np.ndarray]]] = {}   # organism -> per seed (its curves, its points' restoration)
    for result in results.values():
        for kind, frontier in result.get("frontiers", {}).items():
            points = frontier["points"]
            seeds.setdefault(kind, []).append((
                family_curves([p["family"] for p in points], [p["size"]["mean"] for p in points]),
                np.array([p["restoration"]["mean"] for p in points])))
    out = []
    for kind, per_seed in seeds.items():
        if len(per_seed) < len(results):
            continue
        common = [f for f in per_seed[0][0] if all(f in curves for curves, _ in per_seed)]
        for pair in combinations(common, 2):
            lo = max(curves[f][0][0] for curves, _ in per_seed for f in pair)
            hi = min(curves[f][0][-1] for curves, _ in per_seed for f in pair)
            for x in np.unique(np.linspace(lo, hi, MATCH_POINTS)) if lo <= hi else []:
                leads = np.array([seed_lead(curves, restored, pair, x) for curves, restored in per_seed])
                leader, other, leads = (*pair, leads) if leads.mean() >= 0 else (pair[1], pair[0], -leads)
                out.append({"organism": kind, "size": float(math.exp(x)), "leader": leader, "other": other,
                            "leads": leads.tolist(), "lead": t_interval(leads)})
    return out


def seed_lead(curves: dict, restored: np.ndarray, pair: tuple[str, str], x: float) -> float:
    """One seed's restoration of pair[0] minus pair[1] at log size `x` (`sweep.frontier.interpolated`)."""
    first, second = (interpolated(*curves[f], x, restored) for f in pair)
    return float(first - second)


def lead(row: dict[str, Any]) -> float:
    """A cell's share undone minus its controls' median share (NaN without controls)."""
    controls = [c for c in row.get("controls_restoration") or [] if c is not None and not math.isnan(c)]
    return row["restoration"]["share"] - float(np.median(controls)) if controls else math.nan


def _share(o: dict[str, Any]) -> str:
    if o["lo"] is None:
        return f"{o['mean']:.0%} undone"
    return f"{o['mean']:.0%} undone (95% t-interval over seeds {o['lo']:.0%} to {o['hi']:.0%})"
