"""The sweep's run: generate every planned cell with the model loaded once (different cells sharing batches) or on a
server and score each (or, with `--measure kl`, take every cell's teacher-forced KL to the base model: `sweep.kl`),
then each grid cell's effects. Every finished pass is kept in OUT/cells/<id>.jsonl (or a store
shared with other sweeps) and every scored cell in OUT/scores/<id>, so a killed sweep continues where it stopped."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rolemrc.core.artifacts import stamp
from rolemrc.core.io import file_fingerprint, read_jsonl, write_json, write_jsonl
from rolemrc.intervene.spec import Restraint, RestraintError
from rolemrc.sweep.plan import Cell, SweepConfig, plan


def footprint(model: Any, tok: Any, r: Restraint) -> dict[str, Any]:
    """What a restraint touches: units, weight elements a bake at the model's dtype changes (None where it does not
    fold into weights: a patch of a gated MLP's mlp.act), the largest logit shift of its runtime hook on the sample
    prompts."""
    from rolemrc.intervene.bake import elements_changed
    from rolemrc.intervene.check import hook_shift

    dtype = next(model.parameters()).dtype
    try:
        changed = elements_changed(model, r, dtype)
    except RestraintError:
        changed = None
    return {"units": r.num_units, "weight_elements_changed": changed, "max_logit_shift": hook_shift(model, tok, r)}


class CellStore:
    """<dir>/<id>.jsonl per finished cell, written whole (atomically). Ids digest everything a cell's responses
    depend on, so sweeps may share one store: a cell they have in common (the baseline) is generated once."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.dir = Path(folder)

    def path(self, cell: Cell) -> Path:
        return self.dir / f"{cell.id}.jsonl"

    def done(self, cell: Cell) -> bool:
        return self.path(cell).is_file()

    def save(self, cell: Cell, rows: list[dict[str, Any]]) -> None:
        write_jsonl(self.path(cell), rows)

    def load(self, cell: Cell) -> list[dict[str, Any]]:
        return read_jsonl(self.path(cell))


def generate_cells(config: SweepConfig, *, progress: bool = True) -> tuple[list[Cell], CellStore]:
    """Generate (`--measure kl`: measure) every cell not yet in the store (model loaded once; cells share batches, or
    a server's); returns the plan."""
    from rolemrc.core.modeling import dir_fingerprint, load_model, resolve_model
    from rolemrc.core.records import first_cases, read_records
    from rolemrc.intervene.fit import check_origin
    from rolemrc.intervene.inputs import input_hook
    from rolemrc.probe.attribution import config_shape
    from rolemrc.sweep.controls import controls_record
    from rolemrc.sweep.sources import IN_PROCESS, check_rank, engine_label, row_source

    directory = resolve_model(config.model)
    records = first_cases(read_records(config.data, "test")[0], config.limit)
    settings = {"model": dir_fingerprint(directory), "data": file_fingerprint(config.data), "limit": config.limit,
                "max_new_tokens": config.max_new_tokens, "engine": engine_label(config)}
    if config.measure == "kl":   # what else a cell's KL depends on
        settings |= {"measure": "kl", "base": dir_fingerprint(resolve_model(config.base)),
                     "continuation": config.continuation,
                     "neutral": file_fingerprint(config.neutral) if config.neutral else None}
    hook = input_hook(config.diff)
    cells = plan(config, config_shape(directory, hook)["width"], settings)   # every input read before the model loads
    check_rank(config, cells)
    selected = next((c.restraint for c in cells if c.restraint is not None and c.restraint.model), None)
    if selected is not None:   # every selected cell names the same model: the diff's B side
        check_origin(selected, directory, config.strict)
    model, tok = load_model(directory, dtype=config.dtype, device=config.device)
    store = CellStore(config.cells_dir or Path(config.out) / "cells")
    Path(config.out).mkdir(parents=True, exist_ok=True)
    write_json(Path(config.out) / "plan.json", {"config": asdict(config), "settings": settings,
                                                "controls": controls_record(cells), "cells": [c.to_dict() for c in cells]})
    path = Path(config.out) / "footprints.json"
    known = json.loads(path.read_text()) if path.is_file() else {}
    write_json(path, {c.id: known.get(c.id) or footprint(model, tok, c.restraint) for c in cells if c.restraint})
    pending = [c for c in cells if not store.done(c)]
    if not pending:
        return cells, store
    if config.measure == "kl":
        from rolemrc.sweep.kl import measure_cells

        measure_cells(config, pending, store, settings, model, tok, records, progress)
        return cells, store
    if config.base_url or config.engine != IN_PROCESS:
        model = None   # generation happens in a server; the local copy only measured the footprints
    with row_source(config, cells, model, tok, progress=progress) as rows:
        for start in range(0, len(pending), config.cells_per_pass):
            chunk = pending[start:start + config.cells_per_pass]
            results = rows([r for _ in chunk for r in records], [c.restraint for c in chunk for _ in records])
            for k, cell in enumerate(chunk):
                store.save(cell, results[k * len(records):(k + 1) * len(records)])
    return cells, store


def score_cells(cells: list[Cell], store: CellStore, config: SweepConfig, metrics: Any = "all",
                progress: bool = True) -> dict[str, Any]:
    """cell id -> its EvalRun (the config's judge + `metrics`), kept in OUT/scores/<id> and scored again only when
    missing or scored by another judge."""
    from rolemrc.eval.judges import judge_info
    from rolemrc.eval.runs import EvalRun, score

    judge = config.judge_config()
    runs = {}
    for cell in cells:
        folder = Path(config.out) / "scores" / cell.id
        kept = (folder / "report.json").is_file() and EvalRun.load(folder).summary["judge"] == judge_info(judge)
        if not kept:
            score(store.load(cell), judge=judge, metrics=metrics, progress=progress).save(folder, chart=False)
        runs[cell.id] = EvalRun.load(folder)
    return runs


def run_sweep(config: SweepConfig, *, metrics: Any = "all", progress: bool = True) -> dict[str, Any]:
    """Generate and score every cell (resuming what is done), then each grid cell's effect against the baseline
    and against its controls, Holm-corrected over the grid; writes OUT/sweep.json, OUT/sweep.md and the figures."""
    from rolemrc.sweep.plots import write_sweep_figures
    from rolemrc.sweep.report import sweep_markdown, sweep_summary
    from rolemrc.sweep.stats import correct_grid, grid_effects, item_scores

    cells, store = generate_cells(config, progress=progress)
    if config.measure == "kl":
        from rolemrc.sweep.kl import kl_scores, kl_to_base

        scores = kl_scores(cells, store)
    else:
        scores = {k: item_scores(run) for k, run in score_cells(cells, store, config, metrics, progress).items()}
    prints = json.loads((Path(config.out) / "footprints.json").read_text())
    effects = grid_effects(cells, scores)
    correct_grid(effects)
    summary = sweep_summary(config, [c for c in cells if c.kind == "selected"], effects, prints, scores[cells[0].id])
    if config.measure == "kl":
        summary["kl_to_base"] = kl_to_base(cells, store)
    summary["figures"] = write_sweep_figures(summary, config.out)
    write_json(Path(config.out) / "sweep.json", {**stamp("sweep"), **summary})   # the file says what it is
    (Path(config.out) / "sweep.md").write_text(sweep_markdown(summary))
    return summary
