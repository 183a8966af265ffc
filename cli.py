"""The `rolemrc` command: one Typer sub-app per module (each module's `cli.py` exposes `app`)."""

from __future__ import annotations

import importlib

from rolemrc.core.cli import cli_app

# Sub-app name -> module that defines it. Each module's cli keeps heavy imports inside commands.
SUBAPPS: dict[str, tuple[str, str]] = {
    "datagen": ("rolemrc.datagen.cli", "synthesise RoleMRC-style data"),
    "train": ("rolemrc.train.cli", "train the embedded base model, SFT and DPO"),
    "eval": ("rolemrc.eval.cli", "generate, score with metrics and judges, compare runs"),
    "probe": ("rolemrc.probe.cli", "collect top-k unit frequencies, diff them, explore"),
    "intervene": ("rolemrc.intervene.cli", "select, bake and check restraints"),
    "ab": ("rolemrc.serve.ab_cli", "reports on A/B experiments"),
    "bench": ("rolemrc.bench.cli", "benchmarks that print JSON"),
    "models": ("rolemrc.models.cli", "pull pretrained models from the registry, convert GGUF files"),
}

app = cli_app(name="rolemrc", help="RoleMRC end to end: datagen -> train -> eval -> probe -> intervene -> serve.")


def _register(name: str, module: str, help_text: str) -> None:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:  # that module is not part of this installation
            return
        raise
    app.add_typer(mod.app, name=name, help=help_text)


for _name, (_module, _help) in SUBAPPS.items():
    _register(_name, _module, _help)

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
