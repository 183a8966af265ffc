"""`rolemrc ab report EXPERIMENT --db ab.sqlite`: the A/B report from the request log."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, help="A/B experiments served by `rolemrc serve`.")


@app.command("report")
def report_cmd(
    experiment: str = typer.Argument(..., help="experiment id"),
    db: Path = typer.Option(..., help="the server's SQLite log (the config's 'db')"),
    out: Path = typer.Option(None, help="write report.json, chart.html and chart.png here"),
    judge: str = typer.Option("rules", help="rules (offline) | openai"),
    metrics: str = typer.Option("bleu,rouge", help="comma list of bleu, rouge, meteor, bertscore ('' for none)"),
    rounds: int = typer.Option(2000, help="bootstrap rounds"),
) -> None:
    """Per-arm scores with 95% CIs and unpaired tests of each arm against the first."""
    from rolemrc.serve.report import build_report
    from rolemrc.serve.store import Store

    if not db.is_file():
        raise typer.BadParameter(f"{db}: no such database", param_hint="--db")
    store = Store(db)
    try:
        report = build_report(store, experiment, judge=judge, metrics=tuple(m for m in metrics.split(",") if m),
                              rounds=rounds, out_dir=out)
    except KeyError as exc:
        raise typer.BadParameter(str(exc.args[0]), param_hint="EXPERIMENT") from None
    finally:
        store.close()
    typer.echo(json.dumps(report, indent=1))
