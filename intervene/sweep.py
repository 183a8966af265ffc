"""The restraint sweep's plan and generation: a grid of cells (dimension x factor x top-k), each with seeded
random-unit controls and one shared unrestrained baseline, generated with the model loaded once and
different cells sharing batches. Every finished cell is kept in OUT/cells/<id>.jsonl, so a killed sweep
continues where it stopped."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from rolemrc.core.io import file_fingerprint, read_jsonl, write_json, write_jsonl
from rolemrc.intervene.controls import draw_controls
from rolemrc.intervene.select import Direction, select
from rolemrc.intervene.spec import Restraint, RestraintError

BASELINE = "baseline"


@dataclass
class SweepConfig:
    """What a sweep runs: the grid, its controls, and how each cell generates."""

    model: str
    diff: str
    data: str
    out: str
    dimensions: list[str]
    factors: list[float] = field(default_factory=lambda: [1 - 1e-6, 0.99, 0.9, 0.5, 0.0])
    top_k: list[int] = field(default_factory=lambda: [16, 64, 256])
    direction: Direction = "both"
    layers: str | None = None
    controls: int = 3
    seed: int = 0
    max_new_tokens: int = 96
    batch_size: int = 16
    cells_per_pass: int = 4        # cells generated together (sharing batches); each pass is saved when done
    engine: Literal["transformers", "vllm"] = "transformers"   # vllm: a rolemrc server started for the sweep
    base_url: str | None = None    # instead: any OpenAI-compatible rolemrc endpoint serving `model`'s weights
    served_model: str | None = None   # its model id (default: the one unrestrained model it lists)
    api_key_env: str = "OPENAI_API_KEY"
    concurrency: int = 16          # requests in flight (endpoint engines)
    vllm_memory: float | None = None   # the vLLM engine's memory_utilization

    def __post_init__(self) -> None:
        if not self.dimensions:
            raise RestraintError("a sweep needs at least one dimension")
        if self.controls < 0:
            raise RestraintError(f"controls must be >= 0, got {self.controls}")
        if self.cells_per_pass < 1:
            raise RestraintError(f"cells_per_pass must be >= 1, got {self.cells_per_pass}")
        if not self.factors or not self.top_k:
            raise RestraintError("a sweep needs at least one factor and one top-k")
        if self.engine not in ("transformers", "vllm"):
            raise RestraintError(f"engine: transformers or vllm, got {self.engine!r}")
        if self.base_url and self.engine != "transformers":
            raise RestraintError("--base-url generates on a running server; --engine vllm starts one: choose one")


def numbers(text: str, what: str) -> list[float]:
    """'0.5,0' -> [0.5, 0.0]; anything else is a RestraintError naming the option."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise RestraintError(f"{what}: comma-separated numbers, got {text!r}") from None


@dataclass(frozen=True)
class Cell:
    """One generation pass: the baseline (no restraint), a grid cell's selected units, or one of its controls."""

    id: str
    kind: str                      # baseline | selected | control
    grid: dict[str, Any]           # dimension, factor, top_k of the grid cell ({} for the baseline)
    restraint: Restraint | None
    draw: int | None = None        # control index

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "grid": self.grid, "draw": self.draw,
                "restraint": self.restraint.to_dict() if self.restraint else None}


def cell_id(kind: str, restraint: Restraint | None, settings: dict[str, Any]) -> str:
    """A name that changes whenever anything the cell's responses depend on changes."""
    key = json.dumps({"restraint": restraint.to_dict() if restraint else None, **settings}, sort_keys=True, default=str)
    return f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def plan(config: SweepConfig, width: int, settings: dict[str, Any]) -> list[Cell]:
    """The baseline, then per grid cell its selected units and `config.controls` controls. `width`: units at the
    diff's hook point; `settings`: what else responses depend on (model, data, generation)."""
    cells = [Cell(cell_id(BASELINE, None, settings), BASELINE, {}, None)]
    for dimension in config.dimensions:
        for top_k in config.top_k:
            for factor in config.factors:
                grid = {"dimension": dimension, "factor": factor, "top_k": top_k}
                name = f"{dimension.replace('_', '-')}-k{top_k}-x{factor:g}"
                chosen = select(config.diff, dimension, layers=config.layers, top_k=top_k, direction=config.direction,
                                factor=factor, name=name)
                cells.append(Cell(cell_id("selected", chosen, settings), "selected", grid, chosen))
                cells += [Cell(cell_id("control", c, settings), "control", grid, c, draw=k)
                          for k, c in enumerate(draw_controls(chosen, width, config.controls, seed=config.seed))]
    return cells


def footprint(model: Any, tok: Any, r: Restraint) -> dict[str, Any]:
    """What a restraint touches: units, weight elements a bake at the model's dtype changes, the largest logit
    shift of its runtime hook on the sample prompts."""
    from rolemrc.intervene.bake import elements_changed
    from rolemrc.intervene.check import hook_shift

    dtype = next(model.parameters()).dtype
    return {"units": r.num_units, "weight_elements_changed": elements_changed(model, r, dtype),
            "max_logit_shift": hook_shift(model, tok, r)}


class CellStore:
    """OUT/cells/<id>.jsonl per finished cell (written whole, atomically) and OUT/plan.json."""

    def __init__(self, out: str | os.PathLike) -> None:
        self.dir = Path(out) / "cells"

    def path(self, cell: Cell) -> Path:
        return self.dir / f"{cell.id}.jsonl"

    def done(self, cell: Cell) -> bool:
        return self.path(cell).is_file()

    def save(self, cell: Cell, rows: list[dict[str, Any]]) -> None:
        write_jsonl(self.path(cell), rows)

    def load(self, cell: Cell) -> list[dict[str, Any]]:
        return read_jsonl(self.path(cell))


def generate_cells(config: SweepConfig, *, progress: bool = True) -> tuple[list[Cell], CellStore]:
    """Generate every cell not yet in the store (model loaded once; cells share batches, or a server's); returns
    the plan."""
    from rolemrc.core.modeling import dir_fingerprint, load_model
    from rolemrc.core.records import read_records
    from rolemrc.intervene.sweep_sources import engine_label, row_source
    from rolemrc.probe.diff import load_diff
    from rolemrc.probe.hooks import width

    records = read_records(config.data, "test")[0]
    settings = {"model": dir_fingerprint(config.model), "data": file_fingerprint(config.data),
                "max_new_tokens": config.max_new_tokens, "engine": engine_label(config)}
    model, tok = load_model(config.model, device="auto")
    hook = load_diff(config.diff).hook
    cells = plan(config, width(model, hook), settings)
    store = CellStore(config.out)
    Path(config.out).mkdir(parents=True, exist_ok=True)
    write_json(Path(config.out) / "plan.json", {"config": asdict(config), "settings": settings,
                                                "cells": [c.to_dict() for c in cells]})
    path = Path(config.out) / "footprints.json"
    known = json.loads(path.read_text()) if path.is_file() else {}
    write_json(path, {c.id: known.get(c.id) or footprint(model, tok, c.restraint) for c in cells if c.restraint})
    pending = [c for c in cells if not store.done(c)]
    if not pending:
        return cells, store
    if config.base_url or config.engine != "transformers":
        model = None   # generation happens in a server; the local copy only measured the footprints
    with row_source(config, cells, model, tok, progress=progress) as rows:
        for start in range(0, len(pending), config.cells_per_pass):
            chunk = pending[start:start + config.cells_per_pass]
            results = rows([r for _ in chunk for r in records], [c.restraint for c in chunk for _ in records])
            for k, cell in enumerate(chunk):
                store.save(cell, results[k * len(records):(k + 1) * len(records)])
    return cells, store


def score_cells(cells: list[Cell], store: CellStore, out: str | os.PathLike, metrics: Any = "all",
                progress: bool = True) -> dict[str, Any]:
    """cell id -> its EvalRun (rules judge + `metrics`), each scored once and kept in OUT/scores/<id>."""
    from rolemrc.eval.runs import EvalRun, score

    runs = {}
    for cell in cells:
        folder = Path(out) / "scores" / cell.id
        if not (folder / "report.json").is_file():
            score(store.load(cell), judge="rules", metrics=metrics, progress=progress).save(folder, chart=False)
        runs[cell.id] = EvalRun.load(folder)
    return runs


def run_sweep(config: SweepConfig, *, metrics: Any = "all", progress: bool = True) -> dict[str, Any]:
    """Generate and score every cell (resuming what is done), then each grid cell's effect against the baseline
    and against its controls, Holm-corrected over the grid; writes OUT/sweep.json, OUT/sweep.md and the figures."""
    from rolemrc.intervene.sweep_plots import write_sweep_figures
    from rolemrc.intervene.sweep_report import sweep_markdown, sweep_summary
    from rolemrc.intervene.sweep_stats import cell_effects, correct_grid

    cells, store = generate_cells(config, progress=progress)
    runs = score_cells(cells, store, config.out, metrics, progress)
    prints = json.loads((Path(config.out) / "footprints.json").read_text())
    baseline = cells[0]
    selected = [c for c in cells if c.kind == "selected"]
    controls = {c.id: [k for k in cells if k.kind == "control" and k.grid == c.grid] for c in selected}
    effects = {c.id: cell_effects(runs[baseline.id], runs[c.id], [runs[k.id] for k in controls[c.id]])
               for c in selected}
    correct_grid(effects)
    summary = sweep_summary(config, selected, effects, prints, runs[baseline.id])
    summary["figures"] = write_sweep_figures(summary, config.out)
    write_json(Path(config.out) / "sweep.json", summary)
    (Path(config.out) / "sweep.md").write_text(sweep_markdown(summary))
    return summary
