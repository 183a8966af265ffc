"""`rolemrc ab create --from-sweep DIR --base-url URL`: a finished sweep's best cells as an experiment on a running
server; `rolemrc ab bake --from-sweep DIR --model M --out arms`: those cells as checkpoints, served as models of their
own (`ab create --baked arms`); `rolemrc ab report EXPERIMENT --db ab.sqlite`: the report, from the server's request
log."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from rolemrc.core.artifacts import expect
from rolemrc.core.cli import ROUNDS, cli_app
from rolemrc.core.extras import needs
from rolemrc.core.openai_client import ROLEMRC_KEY_ENV
from rolemrc.core.placement import MODEL_HELP, Dtype, device_option, dtype_option
from rolemrc.eval.cli import SCORE, JudgeName
from rolemrc.eval.judges import JudgeConfig
from rolemrc.eval.metrics import metrics_help, parse_metrics
from rolemrc.intervene.fit import STRICT_HELP

app = cli_app(help="A/B experiments served by `rolemrc serve`: create one from a sweep, report on one.")


FROM_SWEEP = typer.Option(..., "--from-sweep", help="a finished `rolemrc sweep run` folder")
CELLS = typer.Option("best:2", help="best:N (ranked by effect against the controls) or cell ids/labels, comma-separated")


@app.command("create")
@needs("serve")
def create_cmd(
    from_sweep: Path = FROM_SWEEP,
    cells: str = CELLS,
    base_url: str = typer.Option(..., help="the running rolemrc server's OpenAI base URL (http://host:port/v1)"),
    model: str = typer.Option(None, help="the served model id (default: the one unrestrained model it lists, baked "
                                         "arms aside)"),
    baked: Path = typer.Option(None, help="the folder `rolemrc ab bake` wrote for these cells: each arm is its baked "
                                          "checkpoint, served as a model the server lists (models.yaml's entries), "
                                          "instead of a restraint registered on --model"),
    id: str = typer.Option(None, "--id", help="experiment id (default: generated)"),
    description: str = typer.Option(None, help="default: which cells, and what the sweep found for each"),
    reveal_arm: bool = typer.Option(True, "--reveal-arm/--no-reveal-arm", help="whether responses say which arm "
                                    "served them (--no-reveal-arm: a blind experiment)"),
    api_key_env: str = typer.Option(ROLEMRC_KEY_ENV, help="env var holding one API key of the server (one of those "
                                    "its config's api_key_env lists)"),
) -> None:
    """Register the chosen cells' restraints on the server and create an A/B experiment: the unrestrained model,
    then one arm per cell (the server must allow client restraint specs: allow_inline_restraints); with --baked, each
    arm is its cell's baked checkpoint, served as a model, and nothing is registered."""
    from rolemrc.ab.from_sweep import experiment_from_sweep

    created = experiment_from_sweep(from_sweep, cells, base_url, model=model, baked=baked, exp_id=id,
                                    description=description, api_key=os.environ.get(api_key_env),
                                    reveal_arm=reveal_arm)
    typer.echo(json.dumps(created, indent=1))


@app.command("bake")
@needs("serve")
def bake_cmd(
    from_sweep: Path = FROM_SWEEP,
    cells: str = CELLS,
    model: Path = typer.Option(..., "--model", help=f"the model the sweep restrained: {MODEL_HELP}"),
    out: Path = typer.Option(..., "--out", help="the arms folder: a checkpoint per arm and models.yaml"),
    dtype: Dtype = dtype_option("dtype to write (each slice computed in float32); auto: the checkpoint's own"),
    device: str = device_option("where to fold: cpu, cuda, cuda:1, ... (auto: cuda if available)"),
    strict: bool = typer.Option(False, "--strict", help=STRICT_HELP),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="a progress bar over the arms"),
) -> None:
    """Bake each chosen cell's restraint into a checkpoint of its own, an A/B arm served as a model: how vLLM serves
    what a LoRA adapter cannot hold (over 512 units in a layer, a patch, a revert). Prints the serve.yaml entries to
    add; then `rolemrc ab create --from-sweep ... --baked OUT`."""
    from rolemrc.ab.bake import bake_arms, serve_snippet

    typer.echo(serve_snippet(bake_arms(from_sweep, cells, model, out, dtype=dtype, device=device, strict=strict,
                                       progress=progress)), nl=False)


@app.command("report")
@needs("eval")
def report_cmd(
    experiment: str = typer.Argument(..., help="experiment id"),
    db: str = typer.Option(..., help="the server's request log, as the serve config's 'db' names it: a SQLite path or a "
                                     "postgresql:// URL"),
    out: Path = typer.Option(None, help="write report.json, chart.html and chart.png here"),
    judge: JudgeName = SCORE["judge"],
    judge_model: str = SCORE["judge_model"],
    judge_base_url: str = SCORE["judge_base_url"],
    metrics: str = typer.Option("bleu,rouge", help=metrics_help()),
    rounds: int = typer.Option(ROUNDS, help="bootstrap resamples (resampling users)"),
    measure: str = typer.Option("judge", help="judge: the judge and reference metrics on the logged responses; kl: "
                                              "those, and every arm scored on every logged request with a reference "
                                              "by teacher-forced KL to --base (paired over users; needs --model)"),
    model: str = typer.Option(None, help="--measure kl: the served model's weights (a directory, pulled name or hub "
                                         "id), which the arms restrain"),
    base: str = typer.Option(None, help="--measure kl: its SFT model, the KL's reference"),
    batch_size: int = typer.Option(8, min=1, help="--measure kl: cases per forward pass"),
) -> None:
    """Per-arm scores with 95% CIs and unpaired tests of each arm against the first, the user as the unit; each arm's
    refused requests, and a `FLAG:` line (also on stderr) when the arms' refusal rates differ (p < 0.05); with
    --measure kl, each arm's restoration (the share of the unrestrained arm's KL to the SFT model it undoes) on
    every logged reference, paired."""
    from rolemrc.ab.report import build_report
    from rolemrc.core.errors import InputError
    from rolemrc.serve.store import Store, is_url

    groups = parse_metrics(metrics)
    # an unknown or misconfigured judge fails here, before any scoring
    config = JudgeConfig(name=judge, model=judge_model, base_url=judge_base_url)
    if measure not in ("judge", "kl"):
        raise InputError(f"--measure: judge or kl, not {measure!r}")
    if measure == "kl" and not (model and base):
        raise InputError("--measure kl needs --model (the served model's weights) and --base (its SFT model)")
    kl = {"model": model, "base": base, "batch_size": batch_size} if measure == "kl" else None
    if not is_url(db):
        expect(Path(db), "sqlite", "--db wants the server's request log (the serve config's 'db')")
    store = Store.open(db)
    try:
        report = build_report(store, experiment, judge=config, metrics=groups, rounds=rounds, out_dir=out, kl=kl)
    finally:
        store.close()
    typer.echo(json.dumps(report, indent=1))
    if (refused := report.get("refusals") or {}).get("flagged"):
        typer.echo(refused["text"], err=True)
