"""`rolemrc intervene select|bake|lora|check|sweep`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from rolemrc.core.cli import cli_app
from rolemrc.core.taxonomy import DIMENSIONS
from rolemrc.probe.hooks import HOOK_POINTS
from rolemrc.probe.ranking import Direction

app = cli_app(help="Restraints: select units from a diff, bake them or export them as LoRA, check them, sweep a grid of them.")


@app.command("select")
def select_cmd(
    diff: Path = typer.Option(..., "--diff", help="diff directory (or its diff.safetensors)"),
    dimension: str = typer.Option(..., help=f"a dimension of the diff: {' | '.join(DIMENSIONS)}, or your own"),
    out: Path = typer.Option(..., "--out", help="spec file to write (.yaml or .json)"),
    layers: str = typer.Option(None, help="e.g. 12-31 or 3,5,7-9 (default: all)"),
    top_k: int = typer.Option(None, help="the k most changed units"),
    fdr: float = typer.Option(None, help="instead of top-k: every unit with BH q below this"),
    direction: Direction = typer.Option("both", help="up: more active under B; down: less; both"),
    factor: float = typer.Option(1 - 1e-6, help="scale; the paper's 1 - 1e-6; 0 ablates"),
    name: str = typer.Option(None, help="restraint name (default: <dimension>-restraint)"),
) -> None:
    """Write a restraint spec for the most changed units of one dimension."""
    from rolemrc.intervene.select import select

    r = select(diff, dimension, layers=layers, top_k=top_k if fdr is None else None, fdr=fdr,
               direction=direction, factor=factor, name=name)
    r.save(out)
    typer.echo(json.dumps({"out": str(out), "name": r.name, "hook": r.hook, "units": r.num_units,
                           "per_layer": {k: len(v) for k, v in r.units.items()}}))


@app.command("bake")
def bake_cmd(
    model: Path = typer.Option(..., "--model", help="source HF model directory"),
    spec: Path = typer.Option(..., "--spec", help="restraint spec at a hook point that bakes: "
                              + " | ".join(name for name, point in HOOK_POINTS.items() if point.fold)),
    out: Path = typer.Option(..., "--out", help="output HF directory"),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16"),
) -> None:
    """Fold the restraint into the weights and write a standard HF checkpoint."""
    from rolemrc.intervene.bake import bake

    report = bake(model, spec, out, dtype)
    typer.echo(json.dumps(report.to_dict(), indent=1))
    if report.numerical_noop:
        typer.secho(f"NUMERICAL NO-OP: no weight element changes at {dtype}", fg=typer.colors.YELLOW, err=True)


@app.command("lora")
def lora_cmd(
    model: Path = typer.Option(..., "--model", help="source HF model directory"),
    spec: Path = typer.Option(..., "--spec", help="restraint spec at a hook point that exports as LoRA: "
                              + " | ".join(name for name, point in HOOK_POINTS.items() if point.fold and point.lora)),
    out: Path = typer.Option(..., "--out", help="output PEFT adapter directory"),
    rank: int = typer.Option(None, help="LoRA rank (default: the smallest vLLM rank that holds the largest layer)"),
) -> None:
    """Export the restraint as an exact PEFT LoRA adapter (B @ A = the bake's weight change)."""
    from rolemrc.intervene.lora import export_lora

    typer.echo(json.dumps(export_lora(model, spec, out, rank=rank).to_dict(), indent=1))


@app.command("check")
def check_cmd(
    model: Path = typer.Option(..., "--model", help="source HF model directory"),
    spec: Path = typer.Option(..., "--spec", help="restraint spec"),
    baked: Path = typer.Option(None, "--baked", help="baked directory to compare with the runtime hook"),
    dtype: str = typer.Option("float32", help="dtype to run and count changes at"),
    device: str = typer.Option("cpu"),
) -> None:
    """Hook vs baked logits, weight elements changed at the dtype, and a no-op verdict."""
    from rolemrc.intervene.check import check

    report = check(model, spec, baked_dir=baked, dtype=dtype, device=device)
    typer.echo(json.dumps(report.to_dict(), indent=1))
    typer.secho(report.verdict, fg=typer.colors.YELLOW if report.numerical_noop else typer.colors.GREEN, err=True)


@app.command("sweep")
def sweep_cmd(
    model: Path = typer.Option(..., "--model", help="HF model directory (the model the diff's B side is)"),
    diff: Path = typer.Option(..., "--diff", help="diff directory"),
    data: Path = typer.Option(..., "--data", help="test JSONL"),
    out: Path = typer.Option(..., "--out", help="sweep folder (rerun with the same folder to resume)"),
    dimension: list[str] = typer.Option(..., help="dimension(s) to select units for; repeatable"),
    factors: str = typer.Option("0.999999,0.99,0.9,0.5,0", help="comma-separated scales"),
    top_k: str = typer.Option("16,64,256", help="comma-separated unit counts"),
    direction: Direction = typer.Option("both", help="up | down | both"),
    layers: str = typer.Option(None, help="e.g. 12-31 (default: all)"),
    controls: int = typer.Option(3, help="random-unit control sets per cell"),
    seed: int = typer.Option(0, help="seed of the control draws"),
    metrics: str = typer.Option("all", help="reference metric groups (all, or e.g. rouge,bleu)"),
    max_new_tokens: int = typer.Option(96, help="generation length"),
    batch_size: int = typer.Option(16, help="rows per generation batch (cells share batches)"),
    cells_per_pass: int = typer.Option(4, help="cells generated together; each finished pass is kept"),
    engine: str = typer.Option("transformers", help="transformers (in this process) | vllm (a rolemrc server with "
                                                    "the vLLM engine, restraints as LoRA adapters)"),
    base_url: str = typer.Option(None, help="generate on a running rolemrc endpoint instead (OpenAI base URL, "
                                            ".../v1; --model is then the local copy of its weights)"),
    served_model: str = typer.Option(None, help="the endpoint's model id (default: the one it lists)"),
    concurrency: int = typer.Option(16, help="requests in flight (endpoint engines)"),
) -> None:
    """Dose-response sweep: every dimension x top-k x factor cell, each against the baseline and against random-unit
    controls (paired per item, Holm over the grid); writes sweep.json, sweep.md."""
    from rolemrc.intervene.sweep import SweepConfig, numbers, run_sweep

    config = SweepConfig(model=str(model), diff=str(diff), data=str(data), out=str(out), dimensions=list(dimension),
                         factors=numbers(factors, "--factors"), top_k=[int(k) for k in numbers(top_k, "--top-k")],
                         direction=direction, layers=layers, controls=controls, seed=seed,
                         max_new_tokens=max_new_tokens, batch_size=batch_size, cells_per_pass=cells_per_pass,
                         engine=engine, base_url=base_url, served_model=served_model, concurrency=concurrency)
    summary = run_sweep(config, metrics="all" if metrics == "all" else tuple(metrics.split(",")))
    typer.echo(json.dumps({"out": str(out), "cells": len(summary["cells"]), "headline": summary["headline"]}))
