"""The one place a recommended selector, budget and factor come from: a calibration's cells turned into a
`Recommendation` (intervene/recommendation.py, the format `intervene select --calibration` reads).

A recipe (selector, budget, factor) is chosen on the selection half of the held-out cases where the calibration
split them (`organism.halves`) and reported on the confirmation half. It is found when it undoes the change of every
planted organism (`finds_change`:
restoration's CI above 0, the planted dimension's cases brought back toward the SFT model beyond the baseline and
the random-unit controls, no other dimension broken), and on the null organism it neither flags, changes nor breaks
any dimension, and every other calibration it is checked against (`against`: the same base under other settings,
e.g. `--quick` beside the full grid) found it too. The best such recipe (highest lower CI bound over the planted
organisms, to the percent, then fewer units) is `found`; the best recipe that undoes at least one planted change
but fails one of those checks is `unstable`, with every reason; `none` when no cell undoes any planted change. The
same for either measure (`CalibrationConfig.measure`): the rows say what restoration, flagged and broken are."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rolemrc.intervene.budget import Budget, coverage_text
from rolemrc.intervene.recommendation import Recommendation
from rolemrc.organism.calibration_config import CalibrationConfig, Organism
from rolemrc.organism.config import NULL
from rolemrc.organism.scoring import finds_change

Recipe = tuple[str, str, float]


def recipe_of(row: dict[str, Any]) -> Recipe:
    return row["selector"], json.dumps(row["budget"], sort_keys=True), row["factor"]


def planted_rows(rows: list[dict[str, Any]]) -> dict[Recipe, dict[str, dict[str, Any]]]:
    """recipe -> planted organism kind -> its cell."""
    out: dict[Recipe, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["organism"] != NULL:
            out.setdefault(recipe_of(r), {})[r["organism"]] = r
    return out


def _undone(kind: str, r: dict[str, Any]) -> str:
    s = r["restoration"]
    return f"{kind} {s['share']:.0%} undone (95% CI {s['lo']:.0%} to {s['hi']:.0%})"


def recommend(rows: list[dict[str, Any]], organisms: list[Organism], config: CalibrationConfig,
              against: list[dict[str, Any]], stability: list[dict[str, Any]] | None = None, *,
              selection: list[dict[str, Any]] | None = None, missed: Sequence[str] = ()) -> Recommendation:
    """The recommendation of a calibration's scored cells (`flag_restorations` done); `against`: other calibrations
    (their calibration.json with `path`) whose cells must agree; `stability`: the selections' overlap across
    resamples (`intervene.stability.selection_stability` rows with `organism`), quoted for the recipe. `selection`:
    the same cells scored on the selection half of the held-out cases (`organism.halves`): the recipe is chosen
    there, and `rows` (the confirmation half) must confirm it and are the only numbers reported. `missed`: the planted
    kinds asked for whose organisms missed their targets and were left out: no recipe is `found` untried on them."""
    rests_on = settings(organisms, config)
    kinds = [o.kind for o in organisms if o.dimension]
    recipes = planted_rows(selection or rows)
    found = {k: v for k, v in recipes.items() if any(finds_change(r) for r in v.values())}
    if not found:
        return Recommendation("none", f"the calibration found no selector that undoes a planted change "
                                      f"({sum(map(len, recipes.values()))} cells tried on {', '.join(kinds)}); name "
                                      "--method and --factor yourself", rests_on=rests_on)

    def strength(recipe: Recipe) -> tuple[int, float, int]:
        """Planted changes undone, the lowest lower CI bound among them to the percent (closer is rounding: under KL
        a cell that is the SFT model undoes 100% give or take 1e-9), fewer units."""
        undone = [r["restoration"]["lo"] for r in found[recipe].values() if finds_change(r)]
        return len(undone), round(min(undone), 2), -next(iter(found[recipe].values()))["units"]

    recipe = max(found, key=strength)
    cells = planted_rows(rows).get(recipe, {}) if selection else found[recipe]
    best = next(iter(found[recipe].values()))
    selector, _, factor = recipe
    where = " on the confirmation half" if selection else ""
    text = (f"{selector} x{factor:g} at {coverage_text(best['coverage'])}{where}: "
            + "; ".join(_undone(k, cells[k]) for k in kinds if k in cells))
    doubts = [f"it did not undo the {k} change{where}" + (f" ({_undone(k, cells[k])}"
                                                    + (f", broke {', '.join(cells[k]['broken'])}" if cells[k]["broken"]
                                                       else "") + ")" if k in cells else " (not tried)")
              for k in kinds if k not in cells or not finds_change(cells[k])]
    twins = [r for r in rows if r["organism"] == NULL and recipe_of(r) == recipe]
    for what, verb in (("flagged", "flagged"), ("changed", "changed"), ("broken", "broke")):
        hit = sorted({d for r in twins for d in r[what]})
        if hit:
            doubts.append(f"on the null organism it {verb} {', '.join(hit)}")
    if not twins:
        doubts.append("there was no null organism to check it on")
    others = [f"{o[0]} x{o[2]:g} at {Budget.of(json.loads(o[1])).label} undid "
              + ", ".join(k for k, r in found[o].items() if finds_change(r)) for o in found if o != recipe]
    doubts += [f"the {k} organism missed its target and was left out, so the recipe was never tried on its change"
               for k in dict.fromkeys(missed) if k != NULL and k not in kinds]
    if others and strength(recipe)[0] < len(kinds):
        doubts.append("no recipe undid every planted change (" + "; ".join(others) + ")")
    holds_over, fails_over = [rests_on], []
    for other in against:
        verdict = _verdict_in(other, recipe)
        if verdict is None:
            holds_over.append(other["recommendation"]["rests_on"])
        else:
            fails_over.append({**other["recommendation"]["rests_on"], "calibration": other["path"], "why": verdict})
            doubts.append(f"in {other['path']} {verdict}")
    label = Budget.of(best["budget"]).label
    steady = [r for r in stability or [] if r["method"] == selector and r["budget"] == label and r["organism"] in kinds]
    text += "".join(f"; its units in {r['organism']} overlap {r['jaccard_mean']:.2f} across {r['resamples']} resamples "
                    f"(Jaccard; chance {r['chance']:.2f})" for r in steady if r["jaccard_mean"] is not None)
    status = "unstable" if doubts else "found"
    return Recommendation(status, text + ("; but " + "; ".join(doubts) if doubts else ""),
                          selector=selector, budget=best["budget"], per_layer=best["coverage"]["per_layer"],
                          share=best["coverage"]["share"], factor=factor, rests_on=rests_on,
                          holds_over=holds_over, fails_over=fails_over)


def _verdict_in(other: dict[str, Any], recipe: Recipe) -> str | None:
    """None when `recipe` undoes every planted change of another calibration and leaves its null alone; else why not."""
    mine = planted_rows(other["cells"]).get(recipe)
    if not mine:
        return "it was not tried"
    missed = [_undone(k, r) for k, r in mine.items() if not finds_change(r)]
    twins = [r for r in other["cells"] if r["organism"] == NULL and recipe_of(r) == recipe]
    null = sorted({d for r in twins for what in ("flagged", "changed", "broken") for d in r[what]})
    why = ([f"it did not undo {'; '.join(missed)}"] if missed else []) + ([f"it moved {', '.join(null)} on the null"]
                                                                          if null else [])
    return "; ".join(why) or None


def settings(organisms: list[Organism], config: CalibrationConfig) -> dict[str, Any]:
    """What the evidence rests on: the measure, probe cases, attribution pairs, held-out cases, DPO steps, seeds,
    controls."""
    planted = next((o for o in organisms if o.dimension), organisms[0] if organisms else None)
    if planted is None:
        return {}
    lines = lambda path: sum(1 for line in Path(path).read_text().splitlines() if line.strip())  # noqa: E731
    return {"base": planted.settings.get("base"), "measure": config.measure, "organisms": [o.kind for o in organisms],
            "probe_cases": lines(planted.probe), "attribution_pairs": config.attribution_pairs,
            "heldout_cases": lines(planted.heldout), "dpo_steps": planted.settings.get("steps"),
            "organism_seed": planted.settings.get("seed"), "control_seed": config.seed, "controls": config.controls,
            "max_new_tokens": config.max_new_tokens}
