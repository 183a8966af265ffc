"""`rolemrc organism calibrate`: does the method find a change whose answer is known?

For each organism (planted, null): probe SFT and DPO together on cases never trained on (last prompt token and every
prompt token), diff them, attribute the DPO margin over the organism's pairs, then per selector x unit budget x
factor restrain the DPO model through the sweep (random-unit controls, Holm) on the held-out cases, measured by KL
to the SFT model (the default) or by the judge (`CalibrationConfig.measure`), and score each cell against the known
answer (scoring.py: restoration and its CI, the cost on every other dimension, the dimensions flagged as brought
back to the SFT model; on the null organism the share of cells flagged is the pipeline's false-positive rate).
Beside it, how many units each diff flags by itself (BH q < 0.05).

The paper's factor 1 - 1e-6 runs as a sweep of its own at the largest budget only (`paper_factor`). From the cells,
one recommendation (organism/recommend.py): the selector, budget and factor `intervene select --calibration` uses, or
why there is none.
Every stage is cached under --out (organisms, probes, diffs, attribution, one sweep per organism and selector, the
sweeps of an organism sharing one store of generated cells, so their common baseline is generated once), so a rerun
of the grid alone only generates the cells that are new.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolemrc.core.io import read_jsonl, write_json, write_jsonl, write_text
from rolemrc.core.stages import StageCache
from rolemrc.core.taxonomy import dimensions_for_task
from rolemrc.intervene.budget import BUDGET_OPTIONS, Budget
from rolemrc.intervene.recommendation import CALIBRATION_FILE, RECOMMENDATION
from rolemrc.organism.calibration_config import (
    ALPHA,
    ORGANISM_SETTINGS,
    PROBE_CASES,
    QUICK_GRID,
    QUICK_PROBE_CASES,
    CalibrationConfig,
    Organism,
    fitting,
    sweeps,
)
from rolemrc.organism.calibration_report import (
    calibration_figure,
    calibration_markdown,
    detection_figure,
    headline,
    recovery,
)
from rolemrc.organism.config import KINDS, KNOWN, PLANTED_DIMENSIONS, OrganismConfig, OrganismError
from rolemrc.organism.halves import case_halves
from rolemrc.organism.recommend import recommend
from rolemrc.organism.scoring import cell_rows, flag_restorations, half_summary, kl_rows, null_rates
from rolemrc.organism.seeds import combine_seeds
from rolemrc.probe.options import DEFAULT_RESAMPLES
from rolemrc.probe.selectors import SELECTORS

BUDGET_KINDS = tuple(k for k in BUDGET_OPTIONS if k != "fdr")
log = logging.getLogger(__name__)
if TYPE_CHECKING:
    from rolemrc.probe.diff import DiffResult


def probe_cases(pairs_file: Path, exclude: set[str], n: int, seed: int) -> list[dict[str, Any]]:
    """`n` test-style cases from datagen's pair prompts that no organism trained on, spread over the tasks."""
    from rolemrc.organism.pairs import sample_prompts

    rows = [r for r in read_jsonl(pairs_file) if r["id"] not in exclude]
    return [{"id": r["id"], "question": r["prompt"], "reference": r["chosen"], "task": r.get("task")}
            for r in sample_prompts(rows, n, seed)]


def attribution_pairs(pairs: list[dict[str, Any]], dimension: str | None, n: int) -> list[dict[str, Any]]:
    """Up to `n` pairs, those whose task counts in `dimension` (if any) first (the attribution selector scores
    that one)."""
    inside = [p for p in pairs if dimension in dimensions_for_task(p.get("task"))]
    return (inside + [p for p in pairs if p not in inside])[:n]


def probe_stages(cache: StageCache, organism: Organism, config: CalibrationConfig, root: Path) -> dict[str, str]:
    """selector input kind -> path: a paired diff per token policy, and the attribution file."""
    from rolemrc.probe import attribute
    from rolemrc.probe.stages import paired_diff_stages

    models = [Path(organism.sft), Path(organism.dpo)]
    inputs = {}
    for tokens in ("last", "all"):
        out = root / f"diff-{tokens}"
        paired_diff_stages(cache, models, Path(organism.probe), paired=root / f"probe-{tokens}.safetensors", diff_dir=out,
                           names=(f"{organism.kind} probe {tokens}", f"{organism.kind} diff {tokens}"), hook=config.hook,
                           tokens=tokens, figures=False)
        inputs[tokens] = str(out)
    chosen = root / "attribution-pairs.jsonl"
    scores = root / "attribution.safetensors"

    def attribute_stage() -> dict:
        write_jsonl(chosen, attribution_pairs(read_jsonl(organism.pairs), organism.dimension, config.attribution_pairs))
        attribute([organism.sft, organism.dpo], str(chosen), hook=config.hook).save(scores)
        return {"out": str(scores)}

    cache.run(f"{organism.kind} attribute", {"models": models, "pairs": Path(organism.pairs), "n": config.attribution_pairs,
                                             "hook": config.hook, "resamples": DEFAULT_RESAMPLES}, attribute_stage, [scores])
    inputs["attribution"] = str(scores)
    return inputs


def diff_flags(result: DiffResult, dimension: str, fdr: float = ALPHA) -> dict[str, int | None]:
    """Units the diff flags by itself in `dimension`: BH q < fdr on the frequency test and on the effect test."""
    count = lambda q: int((q.get(dimension) < fdr).sum()) if dimension in q else None  # noqa: E731
    return {"frequency": count(result.qvalue) if result.tested else None,
            "effect": count(result.effect_q) if result.effect_tested else None}


def neutral_file(organism: Organism, folder: Path) -> Path:
    """--measure kl's neutral texts: the held-out cases' distinct references, one per line, in folder/neutral.txt
    (rewritten only when they change, so the sweep's cells keep their ids)."""
    lines = dict.fromkeys(" ".join(str(r["reference"]).split()) for r in read_jsonl(organism.heldout)
                          if r.get("reference"))
    out, text = folder / "neutral.txt", "\n".join(lines) + "\n"
    if not out.is_file() or out.read_text(encoding="utf-8") != text:
        folder.mkdir(parents=True, exist_ok=True)
        write_text(out, text)
    return out


def sweep_stage(organism: Organism, dimensions: list[str], selector: str, source: str, config: CalibrationConfig,
                out: Path, budgets: list[Budget], factors: list[float], magnitudes: str) -> dict:
    """One sweep (the sweep resumes by itself: finished cells are kept) of `selector` over dimensions x budgets x
    factors, its cells in the organism's shared store; controls matched on the activation moments of the diff
    `magnitudes` (one for every selector, so selectors that choose the same units share their controls too). With
    `config.measure` kl, each cell is scored by its KL to the organism's SFT model on that model's own greedy replies,
    and its perplexity on the held-out references (`neutral_file`)."""
    from rolemrc.sweep import SweepConfig, run_sweep

    kl = ({"base": organism.sft, "neutral": str(neutral_file(organism, out.parent))} if config.measure == "kl"
          else {})
    sweep = SweepConfig(model=organism.dpo, diff=source, data=organism.heldout, out=str(out),
                        cells_dir=str(out.parent / "cells"), dimensions=list(dimensions), factors=list(factors),
                        **{budgets[0].kind: [b.value for b in budgets]}, method=selector, controls=config.controls,
                        magnitudes=magnitudes, measure=config.measure, **kl,
                        seed=config.seed, max_new_tokens=config.max_new_tokens, batch_size=config.batch_size)
    return run_sweep(sweep, metrics=[])


def frontier_stage(organism: Organism, inputs: dict[str, str], config: CalibrationConfig, out: Path,
                   width: int) -> dict:
    """Every restraint kind on the organism's pair for its planted dimension (`sweep.frontier`): units of a selector
    that reads the all-token diff (standardized where calibrated) at the grid's per-layer budgets below the width,
    patch, reverts, directions, controls of each kind; sized by KL from its DPO model on the held-out references
    (`neutral_file`); its known units as the ceiling."""
    from rolemrc.sweep.frontier import FrontierConfig, run_frontier

    per_layer = [int(b.value) for b in fitting(config.budgets(), width) if b.kind == "per_layer"] or [16]
    on_all = [s for s in config.selectors if SELECTORS.get(s).calibrated_on == "all"]   # they read the diff of means
    method = "standardized" if "standardized" in on_all or not on_all else on_all[0]
    frontier = FrontierConfig(model=organism.dpo, base=organism.sft, diff=inputs["all"], data=organism.heldout,
                              dimension=organism.dimension, out=str(out), neutral=str(neutral_file(organism, out.parent)),
                              method=method, per_layer=per_layer, controls=max(10, config.controls),
                              known_units=organism.known_units, seed=config.seed,
                              max_new_tokens=config.max_new_tokens, batch_size=min(config.batch_size, 8))
    return run_frontier(frontier, progress=False)


def correct_organism(ran: list[tuple[str, dict, Path]], cells: int) -> None:
    """One Holm family per comparison over an organism's sweeps: the `cells` grid cells it declared x their scores,
    whether or not every sweep ran (a sweep refused as restraining nothing counts as p = 1), so a cell's verdict does
    not depend on what else ran."""
    from rolemrc.sweep.stats import correct_grid

    effects = {f"{selector}/{c['id']}": c["scores"] for selector, summary, _ in ran for c in summary["cells"]}
    scores = max((len(e) for e in effects.values()), default=0)
    if effects:
        correct_grid(effects, cells * scores)


def calibrate(organisms: list[Organism], config: CalibrationConfig, *, cache: StageCache | None = None,
              against: list[dict[str, Any]] | None = None, missed: list[str] | None = None,
              detect_only: list[Organism] | None = None) -> dict:
    """Probe, select, restrain and score every organism over the grid: a planted organism for the dimension it
    changes, the null for every planted dimension. `against`: other calibrations of the same base (their
    calibration.json, `load_calibration`) the recommendation must agree with; `missed`: kinds asked for whose organisms
    missed their targets (never `found` untried); `detect_only`: units organisms that missed theirs, probed for the
    detection of their S alone (their S still carries their whole update), no cell run on them. Writes
    calibration.json/.md and the figures."""
    from rolemrc.intervene.spec import RestraintError
    from rolemrc.intervene.stability import selection_stability
    from rolemrc.organism.detection import detection_summary, organism_detection
    from rolemrc.probe import load_diff
    root = Path(config.out)
    cache = cache or StageCache(root)
    planted = sorted({o.dimension for o in organisms if o.dimension}) or list(PLANTED_DIMENSIONS)   # a null alone: every one
    rows, selection, stability, flags, sweep_dirs, timing, skipped, detection = [], [], [], {}, {}, {}, {}, {}
    declared: dict[str, int] = {}   # organism kind -> the grid cells it declared (its Holm families' cells)
    frontiers: dict[str, dict] = {}   # organism kind -> its frontier (config.frontier)
    for organism in detect_only or []:
        detection[organism.kind] = organism_detection(organism, probe_stages(cache, organism, config,
                                                                          root / organism.kind), config.seed)
    for organism in organisms:
        folder = root / organism.kind
        inputs = probe_stages(cache, organism, config, folder)
        dimensions = [organism.dimension] if organism.dimension else planted
        diffs = {tokens: load_diff(inputs[tokens]) for tokens in ("last", "all")}
        unseen = [d for d in dimensions if d not in diffs["last"].delta]
        if unseen:
            raise OrganismError(f"none of the {organism.probe} probe cases counts in {', '.join(unseen)}, so no "
                                "selector can rank units for it; raise --probe-cases")
        flags[organism.kind] = {d: {tokens: diff_flags(diffs[tokens], d) for tokens in diffs} for d in dimensions}
        if organism.known_units:
            detection[organism.kind] = organism_detection(organism, inputs, config.seed)   # every selector
        width = int(diffs["last"].meta["width"])   # units per layer at the hook point
        grids = sweeps(config, width)
        if not grids:
            skipped[organism.kind] = f"every budget is at or above the hook point's width ({width} per layer)"
            log.warning("%s: every budget of the grid is at or above %s's %d units per layer at %s, so no cell runs; "
                        "give --per-layer values below %d", organism.kind, organism.sft, width, config.hook, width)
        stability += [{"organism": organism.kind, **row} for selector in config.selectors for d in dimensions
                      for row in selection_stability(inputs[SELECTORS.get(selector).calibrated_on], d, selector,
                                                     fitting(config.budgets(), width))]
        ran = []   # (selector, summary, sweep folder) of the organism's sweeps
        declared[organism.kind] = len(dimensions) * sum(len(b) * len(f) for b, f in grids.values()) * len(config.selectors)
        for selector in config.selectors:
            source = inputs[SELECTORS.get(selector).calibrated_on]
            for suffix, (budgets, factors) in grids.items():
                key, sweep_dir = f"{organism.kind}/{selector}{suffix}", folder / f"sweep-{selector}{suffix}"
                started = time.perf_counter()
                try:
                    summary = sweep_stage(organism, dimensions, selector, source, config, sweep_dir, budgets, factors,
                                          str(inputs["all"]))
                except RestraintError as exc:   # e.g. no unit moved in the selector's view: it restrains nothing
                    skipped[key] = str(exc)
                    continue
                cells = len(json.loads((sweep_dir / "plan.json").read_text())["cells"])
                timing[key] = {"seconds": round(time.perf_counter() - started, 1), "cells": cells}
                sweep_dirs[key] = str(sweep_dir)
                ran.append((selector, summary, sweep_dir))
        if config.frontier and organism.dimension:
            frontiers[organism.kind] = frontier_stage(organism, inputs, config, folder / "frontier", width)
        if config.measure == "kl":   # each half scored and corrected on its own; the confirmation half is reported
            halves = case_halves(organism.heldout, neutral_file(organism, folder), config.seed)
            for half, items in halves.items():
                scored = [(selector, half_summary(summary, sweep_dir, items), sweep_dir)
                          for selector, summary, sweep_dir in ran]
                correct_organism(scored, declared[organism.kind])
                chosen = rows if half == "confirmation" else selection
                chosen += [{**r, "measure": "kl", "half": half} for selector, summary, sweep_dir in scored
                           for r in kl_rows(organism, selector, summary, sweep_dir, items)]
        else:
            correct_organism(ran, declared[organism.kind])
            rows += [r for selector, summary, sweep_dir in ran for r in cell_rows(organism, selector, summary, sweep_dir)]
    flag_restorations(rows, declared)
    result = {"config": asdict(config), "organisms": [asdict(o) for o in organisms], "headline": headline(rows),
              RECOMMENDATION: recommend(rows, organisms, config, against or [], stability,
                                        selection=selection or None, missed=missed or []).to_dict(),
              "recovery": recovery(rows), "stability": stability, "diff_flags": flags, "cells": rows,
              "selection_cells": selection, "sweeps": sweep_dirs, "skipped": skipped,
              "detection": detection_summary([detection]), "timing": timing, **null_rates(rows),
              "frontiers": {kind: {k: f[k] for k in ("headline", "points", "matched", "figures")}
                            for kind, f in frontiers.items()}}
    result["figure"] = calibration_figure(rows, root) if rows else {}
    result["detection_figure"] = detection_figure(result["detection"], root) if detection else {}
    write_json(root / CALIBRATION_FILE, result)
    (root / "calibration.md").write_text(calibration_markdown(result))
    return result


def time_spent(folders: list[Path], sweeps: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Where a calibration's time went, slowest first: every cached stage of the organisms' and the calibration's
    folders (`stages.json`: the seconds each took when it last ran) summed by stage with the organism kind dropped
    ("train dpo" over every kind and seed), and the sweeps' cells (`sweeps`: the calibration's timing)."""
    groups: dict[str, list[float]] = {}
    for folder in folders:
        stages = json.loads((folder / "stages.json").read_text()) if (folder / "stages.json").is_file() else {}
        for name, entry in stages.items():
            first, _, rest = name.partition(" ")
            groups.setdefault(rest if first in KINDS and rest else name, []).append(float(entry.get("seconds") or 0))
    for timing in sweeps.values():
        groups.setdefault("sweep cells", []).append(float(timing["seconds"]))
    total = sum(map(sum, groups.values())) or 1.0
    return sorted(({"stage": k, "runs": len(v), "seconds": round(sum(v), 1), "share": sum(v) / total}
                   for k, v in groups.items()), key=lambda r: -r["seconds"])


def load_calibration(path: str | Path) -> dict[str, Any]:
    """Another calibration (its folder or calibration.json) for the recommendation to agree with, `path` added."""
    from rolemrc.core.artifacts import expect

    path = expect(path, ("calibration", "json"), "--against wants a calibration folder (from `rolemrc organism "
                  "calibrate`) or its calibration.json")
    file = path / CALIBRATION_FILE if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise OrganismError(f"{file}: cannot read it as a calibration ({exc})") from None
    if not isinstance(data, dict) or not all("broken" in c for c in data.get("cells", [None])):
        raise OrganismError(f"{file}: a calibration written before cells were checked for broken dimensions; rerun "
                            f"`rolemrc organism calibrate --out {path if path.is_dir() else path.parent}` with its "
                            "settings (it reuses every stage)")
    return {**data, "path": str(path)}


def hook_size(model: Path, hook: str) -> tuple[int, int]:
    """(layers, units per layer) of `model`'s hook point, from its config alone."""
    from transformers import AutoConfig

    from rolemrc.core.hooks import WIDTHS, hook_point

    config = AutoConfig.from_pretrained(model)
    return int(config.num_hidden_layers), WIDTHS[hook_point(hook).width](config)


def seed_folders(root: Path, seeds: list[int]) -> dict[int, Path]:
    """seed -> its folder under `root`: `root` itself for one seed, `root/seed-S` for each of several."""
    return {seeds[0]: root} if len(seeds) == 1 else {s: root / f"seed-{s}" for s in seeds}


@dataclass
class SeedTask:
    """One seed of a calibration: build its organisms, draw its probe cases, calibrate (a task of its own)."""

    seed: int
    organisms: list[OrganismConfig]
    config: CalibrationConfig
    probe_n: int
    against: list[dict[str, Any]]
    retries: int = 1


RETRY_STRIDE = 1000   # the k-th retry of seed s trains with seed s + k * RETRY_STRIDE, apart from any --seeds range


def build_meeting_target(config: OrganismConfig, retries: int) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The organism `config` builds if it meets its target, else the first of up to `retries` rebuilds with the
    next seeds (each in a folder of its own beside `config.out`, as its held-out cases and data differ) that does;
    and every build that missed (kind, seed, folder, headline). None when none met it: it is never used."""
    from rolemrc.organism.build import build_organism

    missed = []
    for attempt in range(retries + 1):
        tried = config if not attempt else dataclasses.replace(
            config, seed=config.seed + attempt * RETRY_STRIDE, out=f"{config.out}-retry{attempt}-{config.kind}")
        report = build_organism(tried)
        if report["meets_target"]:
            return report, missed
        missed.append({"kind": config.kind, "seed": tried.seed, "folder": tried.out, "headline": report["headline"],
                       "report": report})
        then = (f"retrying with seed {tried.seed + RETRY_STRIDE}" if attempt < retries
                else "it is left out of the calibration")
        log.warning("%s; %s", report["headline"], then)
    return None, missed


def calibrate_seed(task: SeedTask) -> dict[str, Any]:
    """The organisms' reports (kind -> organism.json of those that met their target), those that missed it, the
    calibration of the first and its stage timings, for one seed."""
    built = {c.kind: build_meeting_target(c, task.retries) for c in task.organisms}
    reports = {kind: report for kind, (report, _) in built.items() if report}
    missed = [{k: v for k, v in m.items() if k != "report"} for _, misses in built.values() for m in misses]
    # a units organism that missed its target still has a known answer for detection: its last build
    unmet = {kind: misses[-1]["report"] for kind, (report, misses) in built.items() if kind == KNOWN and not report}
    if not reports and not unmet:
        raise OrganismError(f"seed {task.seed}: no organism met its target ({'; '.join(m['headline'] for m in missed)})"
                            "; try more --max-steps or another --learning-rate")
    trained = sorted({p["id"] for r in [*reports.values(), *unmet.values()] for p in read_jsonl(r["pairs"])})
    out = Path(task.config.out)
    cache = StageCache(out)
    probe = out / "probe-cases.jsonl"
    source = Path(task.organisms[0].out) / "data" / "pairs.jsonl"
    cache.run("probe cases", {"pairs": source, "trained": trained, "n": task.probe_n, "seed": task.seed},
              lambda: {"cases": write_jsonl(probe, probe_cases(source, set(trained), task.probe_n, task.seed))},
              [probe])
    organisms = [Organism.from_report(reports[c.kind], probe) for c in task.organisms if c.kind in reports]
    result = calibrate(organisms, task.config, cache=cache, against=task.against, missed=[m["kind"] for m in missed],
                       detect_only=[Organism.from_report(r, probe) for r in unmet.values()])
    result["missed_targets"] = missed
    write_json(out / CALIBRATION_FILE, result)
    (out / "calibration.md").write_text(calibration_markdown(result))
    return {"reports": reports, "missed": missed, "result": result, "stage_seconds": cache.timings}


def build_and_calibrate(out: Path, *, base: str = "smollm2", quick: bool = False, probe_n: int | None = None,
                        organism_overrides: dict[str, Any] | None = None, organisms_dir: Path | None = None,
                        hook: str = "mlp.act", budgets: dict[str, list[float]] | None = None,
                        against: list[Path] | None = None, kinds: list[str] | None = None,
                        seeds: list[int] | None = None, ray: str | None = None,
                        grid: dict[str, Any] | None = None, retries: int = 1) -> dict:
    """Build every organism of `kinds` (default all) from `base` under `organisms_dir` (default out/organisms;
    cached there, so a folder that `rolemrc organism build` filled with the same settings is reused), once per seed
    (several seeds: one seed-S folder each, in organisms_dir and in out; each seed a task, on the Ray cluster at
    `ray` if given), then calibrate; the command's JSON. budgets: at most one of top_k/per_layer/share -> values,
    instead of the (quick) grid's; grid: other CalibrationConfig settings (controls, measure). against: other
    calibrations of the same base the recommendation must agree with (read before any work); with several seeds, the
    first seed's recommendation must hold on every other seed too. retries: rebuilds, with the next seeds, of an
    organism that misses its target (one that still misses is reported and left out). Every setting is checked before
    anything trains."""
    from rolemrc.core.tasks import check_ray, run_tasks
    from rolemrc.models.pull import model_dir
    from rolemrc.organism.config import QUICK

    seeds = seeds or [0]
    kinds = kinds or list(KINDS)
    if len(set(seeds)) != len(seeds):
        raise OrganismError(f"--seeds: give distinct seeds, got {seeds}")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise OrganismError(f"--kind {', '.join(unknown)}: not an organism kind ({', '.join(KINDS)})")
    chosen = {k: v for k, v in (QUICK_GRID if quick else {}).items() if not budgets or k not in BUDGET_KINDS}
    config = CalibrationConfig(out=str(out), hook=hook, **{**chosen, **(grid or {})}, **(budgets or {}))   # checked
    others = [load_calibration(p) for p in against or []]
    settings = {**ORGANISM_SETTINGS, **(QUICK if quick else {}), **(organism_overrides or {})}
    folders = seed_folders(organisms_dir or out / "organisms", seeds)
    probe_n = probe_n or (QUICK_PROBE_CASES if quick else PROBE_CASES)
    tasks = [SeedTask(s, [OrganismConfig(kind=kind, out=str(folder), base=base, **{**settings, "seed": s})
                          for kind in kinds],
                      CalibrationConfig(**{**asdict(config), "out": str(outs), "seed": s}), probe_n, others, retries)
             for (s, folder), outs in zip(folders.items(), seed_folders(out, seeds).values())]
    if ray:
        check_ray(ray)
    sft = model_dir(base)
    if budgets:
        config.check_fits(*reversed(hook_size(sft, hook)), model=base)
    started = time.perf_counter()
    done = dict(zip(seeds, run_tasks(calibrate_seed, tasks, ray)))
    results = {s: d["result"] for s, d in done.items()}
    result = combine_seeds(results, out, others) if len(seeds) > 1 else results[seeds[0]]
    retried = [Path(m["folder"]) for d in done.values() for m in d["missed"]]
    result["time"] = time_spent([*folders.values(), *retried, *seed_folders(out, seeds).values()], result["timing"])
    write_json(out / CALIBRATION_FILE, result)
    (out / "calibration.md").write_text(calibration_markdown(result))
    timing = [t for r in results.values() for t in r["timing"].values()]
    cells = sum(t["cells"] for t in timing)
    grid_seconds = sum(t["seconds"] for t in timing)
    label = (lambda name, s: f"{name}@{s}") if len(seeds) > 1 else (lambda name, s: name)
    return {"headline": result["headline"], RECOMMENDATION: result[RECOMMENDATION], "quick": quick, "seeds": seeds,
            "ray": ray, "organisms": {label(k, s): {"headline": r["headline"], "meets_target": r["meets_target"],
                                                    "training_seconds": r["training"]["seconds"]}
                                      for s, d in done.items() for k, r in d["reports"].items()},
            "missed_targets": [{**m, "calibration_seed": s} for s, d in done.items() for m in d["missed"]],
            "null_false_positive_rate": result["null_false_positive_rate"], "null_bound": result["null_bound"],
            "null_broken_rate": result["null_broken_rate"], "diff_flags": result["diff_flags"],
            "cells_generated": cells, "grid_seconds": grid_seconds,
            "cells_per_minute": round(60 * cells / grid_seconds, 2) if grid_seconds else None,
            "seconds": round(time.perf_counter() - started, 1),
            "stage_seconds": {label(name, s): t for s, d in done.items() for name, t in d["stage_seconds"].items()},
            "time": result["time"],
            "calibration": str(out / "calibration.json"), "figure": result["figure"]}
