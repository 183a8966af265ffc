"""The demo's numbers: eval headlines with 95% CIs, the restraint verdict, and results.md tables."""

from __future__ import annotations

import json
from pathlib import Path

from rolemrc.eval.metrics import metric_scale


def headline(run_dir: Path) -> dict:
    """The run's key numbers with 95% CIs: judge AvgWeighted and per-dimension means, metric means."""
    report = json.loads((run_dir / "report.json").read_text())
    judge = report.get("judge_aggregates", {})
    pick = lambda d: {k: round(d[k], 4) for k in ("mean", "lo", "hi") if d.get(k) is not None}  # noqa: E731
    return {"judge_avg_weighted": pick(judge.get("averages", {}).get("AvgWeighted", {})),
            "judge_dimensions": {d: pick(v) for d, v in judge.get("dimensions", {}).items()},
            "metrics": {m: pick(v) for m, v in report.get("metrics", {}).items()},
            "metrics_unavailable": report.get("metrics_unavailable", {}), "items": report.get("n_items")}


def verdict_sentence(comparison: dict, check: dict, label: str = "The restraint") -> str:
    """One honest sentence: did the restraint change anything measurable (exact McNemar / sign-flip permutation,
    p < 0.05)?"""
    changed = [f"judge {dim} ({v['a_rate']:.3f} -> {v['b_rate']:.3f}, exact McNemar p={v['p']:.3g})"
               for dim, v in comparison.get("verdicts", {}).items() if v.get("p", 1) < 0.05]
    changed += [f"{name} ({m['diff']:+.4f} [{m['lo']:+.4f}, {m['hi']:+.4f}], sign-flip p={m['p']:.3g})"
                for name, m in comparison.get("metrics", {}).items() if m.get("p", 1) < 0.05]
    flips = sum(v.get("improved", 0) + v.get("worsened", 0) for v in comparison.get("verdicts", {}).values())
    where = f"{check['weight_elements_changed']} weight elements changed, max logit shift " \
            f"{check['hook_vs_original_max_abs']:.2e}"
    if check.get("numerical_noop"):
        return f"{label} is a numerical no-op at {check['dtype']} (factor rounds to 1): nothing could change."
    if changed:
        return f"{label} changed, at p < 0.05: {'; '.join(changed)} ({where})."
    return (f"{label} changed nothing measurable: no judge dimension (McNemar; {flips} verdict flips in all) "
            f"and no reference metric (paired sign-flip test) differs at p < 0.05 ({where}).")


def _ci(value: dict | None, digits: int) -> str:
    if not value or value.get("mean") is None:
        return "–"
    lo, hi = value.get("lo"), value.get("hi")
    ci = f" [{lo:.{digits}f}, {hi:.{digits}f}]" if lo is not None and hi is not None else ""
    return f"{value['mean']:.{digits}f}{ci}"


def _metric_digits(name: str) -> int:
    """Decimals of a raw metric value: 2 for values already in percent (scale 1, BLEU), 3 for fractions."""
    return 2 if metric_scale(name) == 1 else 3


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def results_markdown(summary: dict) -> str:
    """results.md: judge and metric tables (mean [95% CI]) per evaluated model, the largest probe shift,
    and what each restraint did, as measured."""
    evals = summary["eval"]
    dims = sorted({d for e in evals.values() for d in e["judge_dimensions"]})
    metrics = sorted({m for e in evals.values() for m in e["metrics"]})
    shift = summary["largest_shift"]
    lines = [f"# rolemrc demo results: {summary['base']}", "",
             f"Test cases: {summary['test_cases']}. Rules judge, pass rate per dimension; reference metrics per item. "
             "Every value is the mean with its 95% bootstrap CI.", "", "## Judge", ""]
    lines += _table(["model", "AvgWeighted", *dims],
                    [[name, _ci(e["judge_avg_weighted"], 3), *(_ci(e["judge_dimensions"].get(d), 3) for d in dims)]
                     for name, e in evals.items()])
    lines += ["", "## Reference metrics", ""]
    lines += _table(["model", *metrics], [[name, *(_ci(e["metrics"].get(m), _metric_digits(m)) for m in metrics)]
                                          for name, e in evals.items()])
    lines += ["", "## Probe and restraints", "",
              f"Largest SFT -> DPO shift: **{shift['dimension']}** (mean |Δ frequency| {shift['mean_abs_delta']:.4f}, "
              f"{shift['significant_units']} units significant at BH q < 0.05 (exact McNemar), peak layer "
              f"{shift['peak_layer']}).", ""]
    lines += [f"- {effect['conclusion']}" for effect in summary["restraint_effects"].values()]
    if "sweep" in summary:
        lines += ["", *sweep_section(summary["sweep"])]
    return "\n".join(lines) + "\n"


def sweep_section(sweep: dict) -> list[str]:
    """The sweep's headline and, per cell, its judge effects against the baseline and against its controls."""
    from rolemrc.sweep.report import cell_label, effect_text
    from rolemrc.sweep.stats import JUDGE_PREFIX

    judged = sorted({n for c in sweep["cells"] for n in c["scores"] if n.startswith(JUDGE_PREFIX)})
    lines = ["## Restraint sweep", "", f"{sweep['headline']} ({sweep['items']} test cases; full tables and figures: "
             f"{sweep['out']}/sweep.md)", ""]
    header = ["cell", "units", "max Δlogit", *(f"{n.removeprefix(JUDGE_PREFIX)} vs {family}" for n in judged
                                             for family in ("baseline", "controls"))]
    return lines + _table(header, [[cell_label(c), str(c["units"]), f"{c['max_logit_shift']:.3g}",
                                    *(effect_text(c["scores"].get(n), f"vs_{family}") for n in judged
                                      for family in ("baseline", "controls"))] for c in sweep["cells"]])
