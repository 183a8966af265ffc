"""`rolemrc bench <name>`: benchmarks that print JSON (ratios measured side by side in one run)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, help="Benchmarks; each prints JSON and can write it to --out.")


def emit(result: dict, out: Path | None) -> None:
    text = json.dumps(result, indent=1)
    typer.echo(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


@app.command("probe")
def probe_cmd(
    prompts: int = typer.Option(256, help="cases per run (N; memory is also measured at 4N)"),
    length: int = typer.Option(64, help="tokens per prompt"),
    batch_size: int = typer.Option(16),
    repeats: int = typer.Option(3, help="timed repeats per measurement (median)"),
    sizes: str = typer.Option("demo,large", help="comma list of: demo, large"),
    out: Path = typer.Option(None, help="also write the JSON here"),
) -> None:
    """Collect vs plain forward, vs the RoleMRC-code approach, and memory at N vs 4N."""
    from rolemrc.bench.probe import run

    emit(run(prompts, length, batch_size, repeats, tuple(sizes.split(","))), out)


@app.command("retrieval")
def retrieval_cmd(
    profiles: int = typer.Option(10_200, help="profile (query) vectors"),
    triplets: int = typer.Option(808_700, help="triplet (key) vectors"),
    dim: int = typer.Option(384),
    index: str = typer.Option("flat", help="flat (exact) | ivf"),
    seed: int = typer.Option(0),
    out: Path = typer.Option(None, help="also write the JSON here"),
) -> None:
    """Top-1 and bottom-1 inner-product search (datagen retrieval) vs the numpy matmul rate."""
    from rolemrc.bench.retrieval import run

    emit(run(profiles, triplets, dim, kind=index, seed=seed), out)
