"""Scoring a calibration cell against the known answer: how much of the planted change it undoes (restoration, with a
95% CI), its cost on every other dimension, whether it brings a dimension back toward the SFT model beyond its baseline
and random-unit controls (flagged), and which dimensions it breaks. A cell finds the change only if it undoes it
without breaking anything else: a restraint that breaks a model is not one that undoes a change.

Two measures, as the sweep's (`CalibrationConfig.measure`): kl (`kl_rows`), where restoration is the share of the DPO
model's KL to the SFT model a cell undoes on the SFT model's own replies and flags and breaks come from the sweep's
tests against baseline and controls; judge (`judge_rows`), where it is the share of the pass-rate change undone, a
cell flagged when its cases and pass rate come closer to the SFT model's (Holm over an organism's cells) and broken
when it moves a dimension out of the SFT model's 95% CI."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rolemrc.organism.calibration_config import ALPHA, Organism
from rolemrc.organism.config import NULL

BOOTSTRAP = 2000
# nats per token: a DPO model whose mean KL to the SFT model on a dimension's cases is at most this has not moved from
# it there beyond float32 rounding (the test null organism's: -1.5e-8 per token, its weights differing by 1e-3 noise),
# so it has no change to undo, as under the judge where the SFT and DPO models pass alike
KL_FLOOR = 1e-6


def per_item(run_dir: Path | str) -> dict[str, dict[str, float]]:
    from rolemrc.eval.runs import EvalRun
    from rolemrc.sweep.stats import item_scores

    return item_scores(EvalRun.load(run_dir))


def restoration(sft: dict[str, float], dpo: dict[str, float], cell: dict[str, float], *, rounds: int = BOOTSTRAP,
                seed: int = 0) -> dict[str, Any]:
    """Share of the change SFT -> DPO that `cell` undoes, (cell - dpo) / (sft - dpo) over the items all three
    scored, with a paired bootstrap 95% CI (items resampled, numerator and denominator together; resamples with no
    change left out). NaN when SFT and DPO do not differ on these items."""
    ids = sorted(set(sft) & set(dpo) & set(cell))
    s, d, c = (np.array([x[i] for i in ids]) for x in (sft, dpo, cell))
    change = s.mean() - d.mean()
    share = float((c.mean() - d.mean()) / change) if change else float("nan")
    idx = np.random.default_rng(seed).integers(0, len(ids), size=(rounds, len(ids)))
    num, den = c[idx].mean(1) - d[idx].mean(1), s[idx].mean(1) - d[idx].mean(1)
    boot = num[den != 0] / den[den != 0]
    lo, hi = (np.percentile(boot, [2.5, 97.5]).tolist() if boot.size and change else [float("nan")] * 2)
    return {"share": share, "lo": lo, "hi": hi, "n": len(ids), "change": float(change),
            "cell_minus_dpo": float(c.mean() - d.mean())}


def toward_sft(sft: dict[str, dict[str, float]], base: dict[str, dict[str, float]], cell: dict[str, dict[str, float]],
               controls: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """dimension -> how far the cell lies from the SFT model against the baseline and the controls (their mean per
    case): paired tests of the per-case distance |cell - SFT| (`vs_baseline`, `vs_controls`; diff < 0 = closer) and
    the distance of the pass rates (`rate_gap`). Both count: a restraint that breaks the behaviour agrees with SFT
    on the cases SFT fails, and one that only moves the rate can do it with other cases than the ones DPO changed."""
    from rolemrc.core.stats import paired_test

    out = {}
    for name in sorted(set(sft) & set(base) & set(cell)):
        ids = sorted(set(sft[name]) & set(base[name]) & set(cell[name]).intersection(*(c.get(name, {}) for c in controls)))
        if not ids:
            continue
        target = np.array([sft[name][i] for i in ids])
        base_x, mine, *ctrl = (np.array([s[name][i] for i in ids]) for s in (base, cell, *controls))
        entry = {"vs_baseline": paired_test(np.abs(base_x - target), np.abs(mine - target)),
                 "rate_gap": {"baseline": abs(base_x.mean() - target.mean()), "cell": abs(mine.mean() - target.mean())}}
        if ctrl:
            ctrl_x = np.mean(ctrl, axis=0)
            entry["vs_controls"] = paired_test(np.abs(ctrl_x - target), np.abs(mine - target))
            entry["rate_gap"]["controls"] = abs(ctrl_x.mean() - target.mean())
        out[name.removeprefix("judge:")] = entry
    return out


def sft_intervals(sft_eval: str | Path) -> dict[str, tuple[float | None, float | None]]:
    """dimension -> the SFT model's 95% CI of its pass rate (the eval run's bootstrap, stratified by task)."""
    dims = json.loads((Path(sft_eval) / "report.json").read_text())["judge_aggregates"]["dimensions"]
    return {d: (v.get("lo"), v.get("hi")) for d, v in dims.items()}


def broken(rates: dict[str, float], baseline: dict[str, float], intervals: dict[str, tuple[float | None, float | None]],
           changed: list[str], planted: str | None) -> list[str]:
    """The dimensions (but `planted`, which is meant to move) the cell moves out of the SFT model's 95% CI: outside it
    where the unrestrained baseline was inside, or, where the baseline was already outside (a side effect of the
    DPO step), further out than the baseline and changed against it (Holm p < ALPHA). Where that CI has no width
    (every task scored alike), those changed against the baseline."""
    def gap(rate: float, lo: float, hi: float) -> float:
        return max(lo - rate, rate - hi, 0.0)

    out = []
    for dim, rate in sorted(rates.items()):
        lo, hi = intervals.get(dim, (None, None))
        if dim == planted or lo is None or hi is None:
            continue
        base = baseline.get(dim, rate)
        if hi > lo:
            hit = gap(rate, lo, hi) > 0 and (gap(base, lo, hi) == 0 or (gap(rate, lo, hi) > gap(base, lo, hi)
                                                                       and dim in changed))
        else:
            hit = dim in changed
        if hit:
            out.append(dim)
    return out


def cell_rows(organism: Organism, selector: str, summary: dict, sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per grid cell of a sweep, scored by its measure (`kl_rows` or `judge_rows`), the measure named."""
    measure = summary["config"]["measure"]
    rows = (kl_rows if measure == "kl" else judge_rows)(organism, selector, summary, sweep_dir)
    return [{**r, "measure": measure} for r in rows]


def measure_of(row: dict[str, Any]) -> str:
    """The measure a row was scored by (rows written before the KL measure: the judge)."""
    return row.get("measure", "judge")


def _cell_fields(organism: Organism, selector: str, cell: dict[str, Any], planted: dict[str, Any]) -> dict[str, Any]:
    """A row's grid cell, its footprint, and the sweep's tests of the selected dimension's score `planted` against the
    baseline and the controls (Holm over the sweep's grid)."""
    return {"organism": organism.kind, "dimension": cell["dimension"], "selector": selector, "factor": cell["factor"],
            "units": cell["units"], "budget": cell["budget"], "coverage": cell["coverage"],
            "p_vs_baseline": planted.get("vs_baseline", {}).get("p_holm"),
            "p_vs_controls": planted.get("vs_controls", {}).get("p_holm"),
            "diff_vs_baseline": planted.get("vs_baseline", {}).get("diff"),
            "max_logit_shift": cell.get("max_logit_shift")}


def _plan(sweep_dir: Path) -> list[dict[str, Any]]:
    return json.loads((sweep_dir / "plan.json").read_text())["cells"]


def _controls(plan: list[dict[str, Any]], cell: dict[str, Any]) -> list[dict[str, Any]]:
    """The planned controls of a summary's grid cell."""
    grid = {k: cell[k] for k in ("dimension", "factor", "budget")}
    return [c for c in plan if c["kind"] == "control" and c["grid"] == grid]


def judge_rows(organism: Organism, selector: str, summary: dict, sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per grid cell: restoration with CI of the dimension the cell selected for, its controls'
    restoration, p against baseline and controls on that dimension (Holm over the sweep's grid), the cost on the
    other dimensions, the dimensions it changes against the baseline and those it breaks, and its distance to the SFT
    model per dimension (`toward_sft`, Holm-corrected later)."""
    plan = _plan(sweep_dir)
    sft_all = {k: v for k, v in per_item(organism.sft_eval).items() if k.startswith("judge:")}
    intervals = sft_intervals(organism.sft_eval)
    base_id = next(c["id"] for c in plan if c["kind"] == "baseline")
    base_all = per_item(sweep_dir / "scores" / base_id)
    rows = []
    for cell in summary["cells"]:
        key = f"judge:{cell['dimension']}"
        sft, dpo = sft_all.get(key, {}), base_all.get(key, {})
        controls = [per_item(sweep_dir / "scores" / c["id"]) for c in _controls(plan, cell)]
        mine_all = per_item(sweep_dir / "scores" / cell["id"])
        mine = mine_all.get(key, {})
        ctrl = [restoration(sft, dpo, c.get(key, {})) for c in controls]
        others = {n.removeprefix("judge:"): {"diff": e["vs_baseline"]["diff"], "p_holm": e["vs_baseline"]["p_holm"]}
                  for n, e in cell["scores"].items() if n.startswith("judge:") and n != key}
        changed = [n.removeprefix("judge:") for n, e in cell["scores"].items()
                   if n.startswith("judge:") and e["vs_baseline"]["p_holm"] < ALPHA]
        rates, base_rates = ({n.removeprefix("judge:"): float(np.mean(list(v.values()))) for n, v in scores.items()
                              if n.startswith("judge:") and v} for scores in (mine_all, base_all))
        rows.append({**_cell_fields(organism, selector, cell, cell["scores"].get(key, {})),
                     "restoration": restoration(sft, dpo, mine),
                     "controls_restoration": [c["share"] for c in ctrl],
                     "controls_change": [c["cell_minus_dpo"] for c in ctrl],
                     "others": others, "changed": changed,
                     "rates": rates, "broken": broken(rates, base_rates, intervals, changed, organism.dimension),
                     "toward_sft": toward_sft(sft_all, base_all, mine_all, controls)})
    return rows


def kl_restoration(cell: np.ndarray, dpo: np.ndarray) -> dict[str, Any]:
    """1 - mean KL(cell||SFT) / mean KL(DPO||SFT) over cases (the mean of the per-case shares the sweep tests), with
    the cases bootstrap's 95% CI, numerator and denominator resampled together (`core.stats.hierarchical_bootstrap`,
    one seed); `kl_dpo`: the DPO model's mean KL per token to the SFT model on these cases. NaN where that is at or
    below KL_FLOOR: nothing to undo."""
    from rolemrc.core.stats import hierarchical_bootstrap

    kl_dpo = float(np.mean(dpo)) if len(dpo) else math.nan
    if not kl_dpo > KL_FLOOR:
        return {"share": math.nan, "lo": math.nan, "hi": math.nan, "n": len(dpo), "kl_dpo": kl_dpo}
    b = hierarchical_bootstrap([cell], [dpo], stat=lambda n, d: 1 - n / d, rounds=BOOTSTRAP)
    return {"share": b["estimate"], "lo": b["lo"], "hi": b["hi"], "n": b["cases"], "kl_dpo": kl_dpo}


def kl_verdicts(cell: dict[str, Any], planted: str | None, unmoved: list[str]) -> dict[str, list[str]]:
    """What a `--measure kl` sweep's cell (its `scores`, Holm-corrected over the sweep's grid) does at Holm p < ALPHA:
    `changed`, the dimensions whose restoration differs from the baseline's; `flagged`, those restored beyond the
    baseline and the controls; `broken`, the dimensions but `planted` restored less than by the controls (moved away
    from the SFT model), and `neutral_ppl` if the neutral perplexity is above the controls'. Dimensions in `unmoved`
    (no change to undo: their shares are ratios of rounding errors) count in none."""
    from rolemrc.sweep.report import beats_both, wins
    from rolemrc.sweep.stats import NEUTRAL_PPL, RESTORATION_PREFIX

    def measured(names: list[str]) -> list[str]:
        dims = [n.removeprefix(RESTORATION_PREFIX) for n in names if n.startswith(RESTORATION_PREFIX)]
        return [d for d in dims if d not in unmoved]

    return {"changed": sorted(set(measured(wins(cell, "vs_baseline", 1) + wins(cell, "vs_baseline", -1)))),
            "flagged": measured(beats_both(cell)),
            "broken": [d for d in measured(wins(cell, "vs_controls", -1)) if d != planted]
            + [n for n in wins(cell, "vs_controls", 1) if n == NEUTRAL_PPL]}


def _store(summary: dict, sweep_dir: Path) -> Any:
    from rolemrc.sweep.run import CellStore

    return CellStore(summary["config"]["cells_dir"] or sweep_dir / "cells")


def _planned(sweep_dir: Path) -> list[Any]:
    """The sweep's planned cells (baseline first), as the cell store knows them."""
    from rolemrc.sweep.plan import Cell

    return [Cell(c["id"], c["kind"], c["grid"], None) for c in _plan(sweep_dir)]


def half_summary(summary: dict, sweep_dir: Path, items: set[str]) -> dict:
    """A `--measure kl` sweep's summary with each cell's `scores` measured again on `items` alone (a half of the
    held-out cases and neutral texts: `organism.halves`), not yet Holm-corrected."""
    from rolemrc.sweep.kl import kl_scores
    from rolemrc.sweep.stats import grid_effects

    plan = _planned(sweep_dir)
    effects = grid_effects(plan, kl_scores(plan, _store(summary, sweep_dir), items))
    return {**summary, "cells": [{**c, "scores": effects[c["id"]]} for c in summary["cells"]]}


def kl_rows(organism: Organism, selector: str, summary: dict, sweep_dir: Path,
            cases: set[str] | None = None) -> list[dict[str, Any]]:
    """One row per grid cell of a `--measure kl` sweep: restoration of the selected dimension (`kl_restoration`) and
    each control's share, the cell's place among its controls, p against baseline and controls (Holm over the
    sweep's grid); `others`: every other dimension's restoration (below 0: moved away from the SFT model beyond the
    DPO model) and the neutral texts' perplexity change against the baseline; changed, flagged and broken
    (`kl_verdicts`). A dimension where the DPO model's KL is at most KL_FLOOR is `unmoved`: no change to undo.
    `cases`: restoration on those held-out cases alone (the half `summary`'s scores were measured on)."""
    from rolemrc.eval.divergence import restoration as kl_shares
    from rolemrc.sweep.kl import case_ids, stored_result
    from rolemrc.sweep.stats import RESTORATION_PREFIX

    plan = _plan(sweep_dir)
    stored = [_store(summary, sweep_dir).load(c) for c in _planned(sweep_dir)]
    result = stored_result(stored)   # baseline first
    inside = torch.tensor([cases is None or i in cases for i in case_ids(stored[0])], dtype=torch.bool)
    index = {c["id"]: k for k, c in enumerate(plan)}
    dimensions = sorted({d for dims in result.dimensions for d in dims})
    unmoved = [d for d in dimensions if not float(result.dpo[result.mask(d)].mean()) > KL_FLOOR]
    name = lambda n: n.removeprefix(RESTORATION_PREFIX)  # noqa: E731
    rows = []
    for cell in summary["cells"]:
        key, mask = RESTORATION_PREFIX + cell["dimension"], result.mask(cell["dimension"]) & inside
        scores, moved = cell["scores"], cell["dimension"] not in unmoved and bool(mask.any())
        shares = kl_shares(result, mask).value.tolist() if moved else [math.nan] * len(plan)
        entry = scores.get(key, {}) if moved else {}   # unmoved: the sweep's tests are of rounding errors
        others = {name(n): {
            "diff": e["vs_baseline"]["diff"], "p_holm": e["vs_baseline"]["p_holm"],
            **({"vs_controls": e["vs_controls"]["diff"], "p_controls": e["vs_controls"]["p_holm"]}
               if "vs_controls" in e else {})} for n, e in scores.items() if n != key and name(n) not in unmoved}
        rows.append({**_cell_fields(organism, selector, cell, entry),
                     "restoration": kl_restoration(result.kl[index[cell["id"]], mask].numpy(), result.dpo[mask].numpy()),
                     "controls_restoration": [shares[index[c["id"]]] for c in _controls(plan, cell)],
                     "placement": entry.get("placement"), "others": others, "unmoved": unmoved,
                     **kl_verdicts(cell, organism.dimension, unmoved)})
    return rows


def flag_restorations(rows: list[dict[str, Any]], declared: dict[str, int] | None = None) -> None:
    """Judge rows (kl rows are flagged by the sweep's own tests, `kl_rows`): Holm over one organism's cells x
    dimensions per comparison (`declared`: organism kind -> the grid cells it declared, the family's cells whether
    or not all of them ran), then each row's `flagged`: the dimensions whose cases the cell brings closer to the SFT
    model's than both the baseline and its controls do (Holm p < ALPHA), its pass rate closer to SFT's too. On the
    planted organism that is the claim "these units hold the change"; on the null, any flag is a false positive."""
    from rolemrc.core.stats import holm

    for kind in {r["organism"] for r in rows}:
        mine = [r for r in rows if r["organism"] == kind and measure_of(r) == "judge"]   # kl rows: the sweep's flags
        cells = (declared or {}).get(kind, len(mine))
        family = cells * max((len(r["toward_sft"]) for r in mine), default=0)
        for comparison in ("vs_baseline", "vs_controls"):
            tests = [t[comparison] for r in mine for t in r["toward_sft"].values() if comparison in t]
            for test, adjusted in zip(tests, holm([t["p"] for t in tests], max(family, len(tests)))):
                test["p_holm"] = adjusted
        for r in mine:
            r["flagged"] = [d for d, t in r["toward_sft"].items()
                            if all(f in t and t[f]["diff"] < 0 and t[f]["p_holm"] < ALPHA
                                   and t["rate_gap"]["cell"] < t["rate_gap"][f.removeprefix("vs_")]
                                   for f in ("vs_baseline", "vs_controls"))]


def finds_change(row: dict[str, Any]) -> bool:
    """The cell undoes the planted change, by either measure: restoration's CI above 0, the planted dimension flagged
    (brought toward the SFT model beyond the baseline and the controls), and no other dimension broken."""
    return bool(row["restoration"]["lo"] > 0 and row["dimension"] in row["flagged"] and not row["broken"])


def null_rates(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The null organism's share of cells flagged (the false-positive rate), changed and broken, and `null_bound`."""
    null = [r for r in rows if r["organism"] == NULL]
    rate = lambda key: sum(bool(r[key]) for r in null) / len(null) if null else None  # noqa: E731
    return {"null_false_positive_rate": rate("flagged"), "null_changed_rate": rate("changed"),
            "null_broken_rate": rate("broken"), "null_bound": null_bound(rows)}


def null_bound(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What the null organism's cells bound the pipeline's false-positive rate at: a null cell is a false positive
    when it moves any dimension beyond its controls after correction, toward the SFT model (flagged) or away from it
    (broken); those cells of all null cells, the exact one-sided 95% upper bound on the rate, and how many clean null
    cells a bound of 5% needs."""
    from rolemrc.core.stats import rate_upper_bound, trials_for_bound

    null = [r for r in rows if r["organism"] == NULL]
    moved = sum(bool(r["flagged"] or r["broken"]) for r in null)
    return {"flagged": moved, "cells": len(null), "upper_bound": rate_upper_bound(moved, len(null)),
            "cells_for_5pct": trials_for_bound(0.05)}
