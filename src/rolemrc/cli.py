"""The `rolemrc` command: one Typer sub-app per module (each module's `cli.py` exposes `app`)."""

from __future__ import annotations

import importlib
from typing import Any

import typer

from rolemrc.core.cli import cli_app
from rolemrc.core.version import __version__

# Sub-app name -> module that defines it. Each module's cli keeps heavy imports inside commands.
SUBAPPS: dict[str, tuple[str, str]] = {
    "datagen": ("rolemrc.datagen.cli", "synthesise RoleMRC-style data"),
    "train": ("rolemrc.train.cli", "train a small base model from scratch; SFT and DPO on any causal LM"),
    "eval": ("rolemrc.eval.cli", "generate, score with metrics and judges, compare runs"),
    "probe": ("rolemrc.probe.cli", "collect top-k unit frequencies, diff them, explore"),
    "intervene": ("rolemrc.intervene.cli", "select units, restrain them: bake, LoRA export, check"),
    "organism": ("rolemrc.organism.cli", "known-answer organisms (a planted change, a null) and the calibration on them"),
    "sweep": ("rolemrc.sweep.cli", "sweep a grid of restraints against random-unit controls"),
    "ab": ("rolemrc.ab.cli", "A/B experiments: create one from a sweep, report on one"),
    "bench": ("rolemrc.bench.cli", "benchmarks that print JSON"),
    "models": ("rolemrc.models.cli", "pull pretrained models from the registry, convert GGUF files"),
}

app = cli_app(name="rolemrc", help="RoleMRC end to end: datagen -> train -> eval -> probe -> intervene -> serve.")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"rolemrc {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="print rolemrc's version and exit")) -> None:
    """RoleMRC end to end: datagen -> train -> eval -> probe -> intervene -> serve."""


def _optional(module: str) -> Any:
    """`module`, or None when it is not part of this installation."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return None
        raise


subapps = {name: mod.app for name, (module, _) in SUBAPPS.items() if (mod := _optional(module))}
for _name, _app in subapps.items():   # the root's help names every command of each group
    _commands = ", ".join(c.name or c.callback.__name__ for c in _app.registered_commands if not c.hidden)
    app.add_typer(_app, name=_name, help=f"{SUBAPPS[_name][1]} ({_commands})")

for _module in ("rolemrc.serve.cli", "rolemrc.demo"):
    try:
        importlib.import_module(_module).register(app)
    except ModuleNotFoundError as _exc:
        if _exc.name != _module:
            raise


def main() -> None:
    app()


if __name__ == "__main__":
    main()
