"""The one place a recommended selector, budget and factor come from: a calibration's cells turned into a
`Recommendation` (intervene/recommendation.py, the format `intervene select --calibration` reads).

found: a planted cell undoes the change (`finds_change`: restoration's CI above 0, cases brought back toward the SFT
model beyond the baseline and the random-unit controls), and the same recipe on the null organism neither flags nor
changes any dimension, nor does it change another dimension of the planted one; the best such cell (highest lower CI
bound, then fewer units). unstable: the best cell that undoes it fails one of those checks (or there is no null
organism to check it on). none: no cell undoes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rolemrc.intervene.budget import coverage_text
from rolemrc.intervene.recommendation import Recommendation
from rolemrc.organism.calibration_config import CalibrationConfig, Organism
from rolemrc.organism.scoring import finds_change


def recommend(rows: list[dict[str, Any]], organisms: list[Organism], config: CalibrationConfig) -> Recommendation:
    """The recommendation of a calibration's scored cells (`flag_restorations` done)."""
    rests_on = settings(organisms, config)
    planted = [r for r in rows if r["organism"] == "planted"]
    found = [r for r in planted if finds_change(r)]
    if not found:
        return Recommendation("none", f"the calibration found no selector that undoes the planted change ({len(planted)} "
                                      "cells tried); name --method and --factor yourself", rests_on=rests_on)
    best = max(found, key=lambda r: (r["restoration"]["lo"], -r["units"]))
    recipe = (f"{best['selector']} x{best['factor']:g} at {coverage_text(best['coverage'])} undid "
              f"{best['restoration']['share']:.0%} of the planted change (95% CI {best['restoration']['lo']:.0%} to "
              f"{best['restoration']['hi']:.0%})")
    twins = [r for r in rows if r["organism"] == "null" and all(r[k] == best[k] for k in ("selector", "budget", "factor"))]
    doubts = [f"on the null organism it flagged {', '.join(r['flagged'])}" for r in twins if r["flagged"]]
    doubts += [f"on the null organism it changed {', '.join(r['changed'])} against its baseline" for r in twins
               if r["changed"]]
    doubts += [f"it changed {d} too" for d in best["changed"] if d != best["dimension"]]
    if not twins:
        doubts.append("there was no null organism to check it on")
    status = "unstable" if doubts else "found"
    return Recommendation(status, recipe + ("; but " + "; ".join(doubts) if doubts else ""),
                          selector=best["selector"], budget=best["budget"], per_layer=best["coverage"]["per_layer"],
                          share=best["coverage"]["share"], factor=best["factor"], rests_on=rests_on)


def settings(organisms: list[Organism], config: CalibrationConfig) -> dict[str, Any]:
    """What the evidence rests on: probe cases, attribution pairs, held-out cases, DPO steps, seeds, controls."""
    planted = next((o for o in organisms if o.kind == "planted"), organisms[0] if organisms else None)
    if planted is None:
        return {}
    lines = lambda path: sum(1 for line in Path(path).read_text().splitlines() if line.strip())  # noqa: E731
    return {"base": planted.settings.get("base"), "probe_cases": lines(planted.probe),
            "attribution_pairs": config.attribution_pairs, "heldout_cases": lines(planted.heldout),
            "dpo_steps": planted.settings.get("steps"), "organism_seed": planted.settings.get("seed"),
            "control_seed": config.seed, "controls": config.controls, "max_new_tokens": config.max_new_tokens}
