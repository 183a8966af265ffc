"""`rolemrc sweep run`: a grid of restraints against the baseline and random-unit controls (`rolemrc ab create
--from-sweep` serves its best cells as an A/B experiment)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from rolemrc.core.cli import LIMIT, choice, cli_app, live_choices
from rolemrc.core.errors import InputError
from rolemrc.core.extras import needs
from rolemrc.core.placement import MODEL_HELP, Dtype, device_option, dtype_option
from rolemrc.eval.cli import SCORE, JudgeName
from rolemrc.eval.generate import Continuation
from rolemrc.intervene.budget import BUDGET_KINDS, GRID_ONE
from rolemrc.intervene.spec import KINDS
from rolemrc.probe.options import Direction
from rolemrc.probe.selectors import SELECTORS
from rolemrc.serve.engines import EngineName
from rolemrc.sweep.frontier import FAMILY_KINDS
from rolemrc.sweep.plan import CONTROLS, FACTORS, SHARES, TOP_LAYERS, Measure

GRID_HELP = f"{GRID_ONE}; default: --share {','.join(map(str, SHARES))}"

SweepKind = choice(KINDS)   # revert among them, refused with its reason and where it is compared (SweepConfig)
Method = choice(SELECTORS)   # --method: the selectors registered when the CLI is built (`live_choices`)
app = cli_app(help="Restraint sweeps: a grid of restraints against the baseline and random-unit controls.")


@app.command("run", cls=live_choices(method=SELECTORS))
@needs("eval")
def run_cmd(
    model: Path = typer.Option(..., "--model", help=f"the model the diff's B side is: {MODEL_HELP}"),
    diff: Path = typer.Option(..., "--diff", help="diff directory (for --method attribution: an attribution file)"),
    data: Path = typer.Option(..., "--data", help="test JSONL"),
    limit: int = LIMIT,
    out: Path = typer.Option(..., "--out", help="sweep folder (rerun with the same folder to resume)"),
    dimension: list[str] = typer.Option(..., help="dimension(s) to select units for; repeatable"),
    factors: str = typer.Option(None, help="comma-separated scales (default: "
                                f"{','.join(f'{f:.10g}' for f in FACTORS)}; --kind patch or direction: 0, its only one)"),
    kind: SweepKind = typer.Option("scale", "--kind", help="what each cell does: scale its units (by --factors); patch "
                                   "them to the SFT mean (--means); direction: project the diff's difference of means "
                                   "out of its --top-layers, against random unit directions there. revert is refused "
                                   "(no runtime hook): every kind side by side, reverts included, is `rolemrc sweep "
                                   "frontier`"),
    means: Path = typer.Option(None, "--means", help="--kind patch: a diff with activation moments whose A side's "
                               "means the units are set to (default: --diff)"),
    method: Method = typer.Option(None, "--method", help="unit selector, named (see `rolemrc intervene select "
                                  "--help`; what each did on the calibration: docs/calibration.md); not --kind direction's"),
    top_k: str = typer.Option(None, help=f"comma-separated global unit counts ({GRID_HELP})"),
    per_layer: str = typer.Option(None, help=f"comma-separated units from each selected layer ({GRID_HELP})"),
    share: str = typer.Option(None, help="comma-separated shares of all units of the selected layers, ranked over them "
                                         f"({GRID_HELP})"),
    top_layers: str = typer.Option(None, help="--kind direction's budgets: comma-separated N, the direction in the N "
                                   f"layers where it is longest (default: {','.join(map(str, TOP_LAYERS))})"),
    direction: Direction = typer.Option("both", help="up | down | both"),
    layers: str = typer.Option(None, help="e.g. 12-31 (default: all)"),
    controls: int = typer.Option(CONTROLS, help="random controls per cell: unit sets matched on activation magnitude "
                                 "(--kind direction: random unit directions in its layers)"),
    magnitudes: Path = typer.Option(None, help="a diff whose activation moments the controls are matched on (default: "
                                               "--diff when it is one; else the controls are uniform per layer)"),
    seed: int = typer.Option(0, help="seed of the control draws"),
    measure: Measure = typer.Option("judge", help="judge: generate each cell's replies and score them (judge, "
                                            "metrics); kl: one teacher-forced forward pass per case, scored by the "
                                            "share of the DPO model's KL to --base undone, per dimension"),
    base: Path = typer.Option(None, "--base", help=f"--measure kl: the SFT model --model was trained from: {MODEL_HELP}"),
    continuation: Continuation = typer.Option("sft", help="--measure kl: the text scored after each prompt: "
                                                       "the --base model's greedy reply (sft), --model's (dpo), or the "
                                                       "record's reference"),
    neutral: Path = typer.Option(None, "--neutral", help="--measure kl: plain text, a passage per line; each cell's "
                                                         "perplexity on it against the DPO model's"),
    metrics: str = typer.Option("all", help="reference metric groups (all, or e.g. rouge,bleu)"),
    judge: JudgeName = SCORE["judge"],
    judge_model: str = SCORE["judge_model"],
    judge_base_url: str = SCORE["judge_base_url"],
    max_new_tokens: int = typer.Option(96, help="generation length"),
    batch_size: int = typer.Option(32, help="rows the engine decodes together (cells share them)"),
    cells_per_pass: int = typer.Option(4, help="cells generated together; each finished pass is kept"),
    engine: EngineName = typer.Option(EngineName.transformers, help="a serve engine: transformers (in this process), "
                                      "vllm (a rolemrc server with the vLLM engine, restraints as LoRA adapters)"),
    base_url: str = typer.Option(None, help="generate on a running rolemrc endpoint instead (OpenAI base URL, "
                                            ".../v1; --model is then the local copy of its weights)"),
    engine_options: str = typer.Option(None, help="--engine vllm: more of its serve options as JSON, e.g. "
                                       '\'{"vllm_args": ["--tensor-parallel-size", "2"], "memory_utilization": 0.8}\''),
    served_model: str = typer.Option(None, help="the endpoint's model id (default: the one it lists)"),
    concurrency: int = typer.Option(16, help="requests in flight (endpoint engines)"),
    cells_dir: Path = typer.Option(None, help="store of generated cells (default OUT/cells); sweeps sharing one "
                                              "generate a cell they have in common (the baseline) once"),
    strict: bool = typer.Option(False, "--strict", help="refuse a diff of another model than --model (default: a "
                                "warning naming both)"),
    dtype: Dtype = dtype_option(),
    device: str = device_option(),
) -> None:
    """Dose-response sweep: every dimension x budget x factor cell, each against the baseline and against random-unit
    controls (paired per item, Holm over the grid), by the judge or (--measure kl) by KL to the --base model; writes
    sweep.json, sweep.md."""
    from rolemrc.sweep.plan import SweepConfig, numbers
    from rolemrc.sweep.run import run_sweep

    try:
        options = json.loads(engine_options) if engine_options else {}
    except json.JSONDecodeError as exc:
        raise InputError(f"--engine-options is not JSON: {exc}") from None
    config = SweepConfig(model=str(model), diff=str(diff), data=str(data), out=str(out), dimensions=list(dimension),
                         factors=numbers(factors, "--factors") if factors else list(FACTORS if kind == "scale" else [0.0]),
                         method=method, kind=kind,
                         means=str(means) if means else None,
                         **{key: numbers(text, BUDGET_KINDS[key]) for key, text in
                            (("top_k", top_k), ("per_layer", per_layer), ("share", share), ("top_layers", top_layers))
                            if text is not None},
                         direction=direction, layers=layers, controls=controls,
                         magnitudes=str(magnitudes) if magnitudes else None, seed=seed,
                         max_new_tokens=max_new_tokens, batch_size=batch_size, cells_per_pass=cells_per_pass,
                         engine=engine.value, engine_options=options, base_url=base_url, served_model=served_model,
                         concurrency=concurrency,
                         judge=judge, judge_model=judge_model, judge_base_url=judge_base_url,
                         cells_dir=str(cells_dir) if cells_dir else None, measure=measure,
                         base=str(base) if base else None, continuation=continuation,
                         neutral=str(neutral) if neutral else None, strict=strict, limit=limit, dtype=dtype,
                         device=device)
    summary = run_sweep(config, metrics="all" if metrics == "all" else tuple(metrics.split(",")))
    typer.echo(json.dumps({"out": str(out), "cells": len(summary["cells"]), "headline": summary["headline"]}))


@app.command("frontier", cls=live_choices(method=SELECTORS))
@needs("eval")
def frontier_cmd(
    model: Path = typer.Option(..., "--model", help=f"the DPO model: {MODEL_HELP}"),
    base: Path = typer.Option(..., "--base", help=f"the SFT model it was trained from: {MODEL_HELP}"),
    diff: Path = typer.Option(..., "--diff", help="a diff of --base (A) vs --model (B) with activation moments: the "
                              "units, the patch means and the directions come from it"),
    data: Path = typer.Option(..., "--data", help="test JSONL; restoration is read on the cases of --dimension"),
    dimension: str = typer.Option(..., help="the dimension whose change the restraints should undo"),
    out: Path = typer.Option(..., "--out", help="frontier folder"),
    neutral: Path = typer.Option(None, "--neutral", help="plain text, a passage per line: each restraint's size is its "
                                 "KL from --model there (default: the distinct references of the other cases)"),
    pairs: Path = typer.Option(None, "--pairs", help="held-out preference pairs (JSONL): the share of DPO's reward "
                               "margin each restraint keeps"),
    method: Method = typer.Option("standardized", "--method", help="unit selector of the unit families"),
    attribution: Path = typer.Option(None, help="--method attribution: the pair's attribution file"),
    families: str = typer.Option(",".join(FAMILY_KINDS), help="comma-separated: " + ", ".join(FAMILY_KINDS)),
    per_layer: str = typer.Option("4,16,64", help="units per layer of the unit families (those below the width)"),
    factors: str = typer.Option("0", help="scale family factors (one curve each)"),
    unit_alphas: str = typer.Option("1", help="unit and layer revert alphas (one curve each)"),
    model_alphas: str = typer.Option("0.05,0.1,0.2,0.4,0.7,1", help="whole-model revert alphas (one curve)"),
    top_layers: str = typer.Option("1,2,4", help="direction and revert-layers families: the N layers where the "
                                   "difference of means is longest (revert-layers: N of at most half the layers)"),
    controls: int = typer.Option(10, min=10, help="controls of the same kind and size per point"),
    known_units: Path = typer.Option(None, "--known-units", help="the units that carry the change (a units "
                                     "organism's known_units.json): `patch S` and `revert S` drawn as the ceiling"),
    seed: int = typer.Option(0, help="seed of the control draws and the bootstrap"),
    limit: int = LIMIT,
    max_new_tokens: int = typer.Option(64, help="the --base model's greedy continuation of each case"),
    batch_size: int = typer.Option(8, help="sequences per forward"),
    dtype: Dtype = dtype_option(),
    device: str = device_option(),
) -> None:
    """Every restraint kind on one pair and one dimension, against controls of its own kind, in one currency of size
    (KL from --model on neutral texts): restoration curves, the matched-size comparison, the margin kept; writes
    frontier.json, frontier.md and frontier.html/png."""
    from rolemrc.intervene.inputs import read_units
    from rolemrc.sweep.frontier import FrontierConfig, run_frontier
    from rolemrc.sweep.plan import numbers

    config = FrontierConfig(model=str(model), base=str(base), diff=str(diff), data=str(data), dimension=dimension,
                            out=str(out), neutral=str(neutral) if neutral else None, pairs=str(pairs) if pairs else None,
                            method=method, attribution=str(attribution) if attribution else None,
                            families=[f.strip() for f in families.split(",") if f.strip()],
                            per_layer=[int(k) for k in numbers(per_layer, "--per-layer")],
                            factors=numbers(factors, "--factors"), unit_alphas=numbers(unit_alphas, "--unit-alphas"),
                            model_alphas=numbers(model_alphas, "--model-alphas"),
                            top_layers=[int(k) for k in numbers(top_layers, "--top-layers")], controls=controls,
                            known_units=read_units(known_units) if known_units else None, seed=seed, limit=limit,
                            max_new_tokens=max_new_tokens, batch_size=batch_size, dtype=dtype,
                            device=device)
    summary = run_frontier(config)
    typer.echo(json.dumps({"out": str(out), "points": len(summary["points"]), "headline": summary["headline"]}))
