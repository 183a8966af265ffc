"""`rolemrc demo`: every stage on the embedded default, offline, cached by input fingerprint.

datagen (template) -> train base -> SFT -> DPO -> eval SFT and DPO -> probe both -> diff + explorer ->
restraint for the dimension with the largest shift -> bake + check -> eval before/after + compare ->
serve the restrained model and call it with the openai client -> summary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from rolemrc.core.stages import StageCache

console = Console()


def data_stage(cache: StageCache, out: Path, size: str) -> Path:
    from rolemrc.datagen.config import DatagenConfig
    from rolemrc.datagen.pipeline import run

    data = out / "data"
    cache.run("datagen", {"size": size, "backend": "template", "seed": 0},
              lambda: _jsonable(run(DatagenConfig(out=data, size=size))),
              [data / f for f in ("sft.jsonl", "pairs.jsonl", "test.jsonl")])
    return data


def train_stages(cache: StageCache, out: Path, data: Path, profile: str) -> dict[str, Path]:
    from rolemrc.train import BaseTrainConfig, DPOTrainConfig, SFTTrainConfig, make_config, train_base, train_dpo, train_sft

    dirs = {name: out / name for name in ("base", "sft", "dpo")}
    sft_data, pairs = data / "sft.jsonl", data / "pairs.jsonl"

    def train(fn, cls, **kw):
        return lambda: _result(fn(make_config(cls, profile=profile, **kw)))

    cache.run("train base", {"data": [sft_data, pairs], "profile": profile},
              train(train_base, BaseTrainConfig, data=[str(sft_data), str(pairs)], out=str(dirs["base"])),
              [dirs["base"] / "config.json"])
    cache.run("train sft", {"model": dirs["base"], "data": sft_data, "profile": profile},
              train(train_sft, SFTTrainConfig, model=str(dirs["base"]), data=[str(sft_data)], out=str(dirs["sft"])),
              [dirs["sft"] / "config.json"])
    cache.run("train dpo", {"model": dirs["sft"], "data": pairs, "profile": profile},
              train(train_dpo, DPOTrainConfig, model=str(dirs["sft"]), data=[str(pairs)], out=str(dirs["dpo"])),
              [dirs["dpo"] / "config.json"])
    return dirs


def probe_stages(cache: StageCache, out: Path, models: dict[str, Path], test: Path, hook: str) -> dict:
    from rolemrc.probe import collect, diff, write_diff
    from rolemrc.probe.explorer import write_explorer

    files = {}
    for name in ("sft", "dpo"):
        files[name] = out / "probe" / f"{name}.safetensors"
        cache.run(f"probe {name}", {"model": models[name], "data": test, "hook": hook},
                  lambda name=name: _probe_report(collect(models[name], test, hook=hook).save(files[name])),
                  [files[name]])
    diff_dir = out / "diff"
    summary = cache.run("probe diff", {"a": files["sft"], "b": files["dpo"]},
                        lambda: write_diff(diff(files["sft"], files["dpo"]), diff_dir), [diff_dir / "diff.safetensors"])
    explorer = out / "explorer.html"
    cache.run("explorer", {"diff": diff_dir / "diff.safetensors"},
              lambda: {"out": str(write_explorer(diff_dir, explorer))}, [explorer])
    return {"diff_dir": str(diff_dir), "explorer": str(explorer), "summary": summary}


def _probe_report(path: Path) -> dict:
    from rolemrc.probe import ProbeCounts

    counts = ProbeCounts.load(path)
    return {"out": str(path), "cases": counts.cases, "empty_dimensions": counts.empty_dimensions}


def _result(result: Any) -> dict:
    return {"out_dir": str(result.out_dir), "metrics": result.metrics, "seconds": round(result.seconds, 1),
            "data": _jsonable(result.data)}


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def run_demo(out: Path, *, size: str = "small", profile: str = "tiny", hook: str = "mlp.act",
             force: bool = False) -> dict:
    """Run (or reuse) every stage under `out`; returns the summary also written to out/summary.json."""
    cache = StageCache(out, force=force, console=console)
    data = data_stage(cache, out, size)
    models = train_stages(cache, out, data, profile)
    probe = probe_stages(cache, out, models, data / "test.jsonl", hook)
    summary = {"out": str(out), "data": str(data), "models": {k: str(v) for k, v in models.items()},
               "probe": {k: v for k, v in probe.items() if k != "summary"},
               "largest_shift": probe["summary"]["largest_shift"], "stage_seconds": cache.timings}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo_cmd(
        out: Path = typer.Option(Path("runs/demo"), help="where every artifact goes"),
        size: str = typer.Option("small", help="datagen size preset"),
        profile: str = typer.Option("tiny", help="training profile"),
        hook: str = typer.Option("mlp.act", help="probe hook point"),
        force: bool = typer.Option(False, help="rerun every stage even if its inputs are unchanged"),
    ) -> None:
        """The whole pipeline on the embedded default, offline; a rerun reuses finished stages."""
        summary = run_demo(out, size=size, profile=profile, hook=hook, force=force)
        console.rule("[bold]summary")
        console.print_json(json.dumps(summary))
