"""`rolemrc ab report EXPERIMENT --db ab.sqlite`: the A/B report from the request log (and `ab create --from-sweep`,
mounted here by `rolemrc.cli` from `rolemrc.sweep.cli`)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from rolemrc.core.artifacts import expect
from rolemrc.core.cli import ROUNDS, cli_app
from rolemrc.core.extras import needs
from rolemrc.eval.judges import JUDGES, JudgeConfig
from rolemrc.eval.metrics import metrics_help, parse_metrics

app = cli_app(help="A/B experiments served by `rolemrc serve`.")


@app.command("report")
@needs("serve")
def report_cmd(
    experiment: str = typer.Argument(..., help="experiment id"),
    db: Path = typer.Option(..., help="the server's SQLite log (the config's 'db')"),
    out: Path = typer.Option(None, help="write report.json, chart.html and chart.png here"),
    judge: str = typer.Option("rules", help=f"{JUDGES.listing(' | ')} (rules: offline)"),
    judge_model: str = typer.Option(None, help="the judge model (endpoint judges, e.g. openai)"),
    judge_base_url: str = typer.Option(None, help="the judge's OpenAI-compatible base URL (endpoint judges)"),
    metrics: str = typer.Option("bleu,rouge", help=metrics_help()),
    rounds: int = typer.Option(ROUNDS, help="bootstrap resamples (resampling users)"),
) -> None:
    """Per-arm scores with 95% CIs and unpaired tests of each arm against the first, the user as the unit."""
    from rolemrc.serve.report import build_report
    from rolemrc.serve.store import Store

    groups = parse_metrics(metrics)
    # an unknown or misconfigured judge fails here, before any scoring
    config = JudgeConfig(name=judge, model=judge_model, base_url=judge_base_url)
    expect(db, "sqlite", "--db wants the server's SQLite log (the serve config's 'db')")
    store = Store(db)
    try:
        report = build_report(store, experiment, judge=config, metrics=groups, rounds=rounds, out_dir=out)
    finally:
        store.close()
    typer.echo(json.dumps(report, indent=1))
