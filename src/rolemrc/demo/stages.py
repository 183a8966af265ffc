"""The demo's cached stages: each one a StageCache entry keyed by its inputs' fingerprints."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from rolemrc.core.stages import StageCache
from rolemrc.demo.config import DemoConfig
from rolemrc.demo.report import headline

SWEEP_METRICS = ("bleu", "rouge")   # the sweep's reference metrics (the judge covers every dimension)


def data_stage(cache: StageCache, cfg: DemoConfig) -> Path:
    from rolemrc.datagen.config import DatagenConfig
    from rolemrc.datagen.pipeline import run

    data = cfg.out / "data"
    cache.run("datagen", {"size": cfg.size, "backend": "template", "seed": 0},
              lambda: _jsonable(run(DatagenConfig(out=data, size=cfg.size))),
              [data / f for f in ("sft.jsonl", "pairs.jsonl", "test.jsonl")])
    return data


def base_model(cfg: DemoConfig) -> Path:
    """The pretrained starting point (`models.pull.model_dir`)."""
    from rolemrc.models.pull import model_dir

    return model_dir(cfg.base)


def train_stages(cache: StageCache, cfg: DemoConfig, data: Path, start: Path | None) -> dict[str, Path]:
    """SFT then DPO from `start`; with no start, a base model is first trained on the demo data."""
    from rolemrc.train import BaseTrainConfig, DPOTrainConfig, SFTTrainConfig, make_config, train_base, train_dpo, train_sft

    sft_data, pairs = data / "sft.jsonl", data / "pairs.jsonl"
    dirs = {name: cfg.out / name for name in ("sft", "dpo")}
    stages = [("sft", train_sft, SFTTrainConfig, [str(sft_data)]), ("dpo", train_dpo, DPOTrainConfig, [str(pairs)])]
    if start is None:
        dirs = {"base": cfg.out / "base", **dirs}
        stages.insert(0, ("base", train_base, BaseTrainConfig, [str(sft_data), str(pairs)]))
    model = start
    for name, fn, cls, files in stages:
        kw = {"model": str(model)} if model is not None else {}
        config = make_config(cls, profile=cfg.profile, out=str(dirs[name]), data=files, **kw)
        settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("out", "progress")}
        inputs = [Path(f) for f in files] + ([model] if model is not None else [])
        cache.run(f"train {name}", {"inputs": inputs, "settings": settings},
                  lambda fn=fn, config=config: _result(fn(config)), [dirs[name] / "config.json"])
        model = dirs[name]
    return dirs


def eval_stage(cache: StageCache, cfg: DemoConfig, name: str, model: Path, test: Path) -> dict:
    """Generate on the test set and score (rules judge + every registered reference metric, bootstrap CIs)."""
    from rolemrc.eval import generate, score
    from rolemrc.eval.metrics import METRICS

    run_dir = cfg.out / "eval" / name
    metrics = METRICS.names()

    def run() -> dict:
        items = generate(test, model=str(model), max_new_tokens=cfg.max_new_tokens)
        score(items, judge="rules", metrics=metrics, progress=True).save(run_dir)
        return {"run": str(run_dir), **headline(run_dir)}

    return cache.run(f"eval {name}", {"model": model, "data": test, "max_new_tokens": cfg.max_new_tokens,
                                      "metrics": metrics}, run, [run_dir / "report.json"])


def probe_stages(cache: StageCache, cfg: DemoConfig, models: dict[str, Path], test: Path) -> dict:
    """SFT and DPO probed together (one paired file), diffed with the exact McNemar test per unit, and the explorer."""
    from rolemrc.probe.explorer import write_explorer
    from rolemrc.probe.stages import paired_diff_stages

    diff_dir = cfg.out / "diff"
    summary = paired_diff_stages(cache, [models["sft"], models["dpo"]], test, paired=cfg.out / "probe" / "sft-dpo.safetensors",
                                 diff_dir=diff_dir, names=("probe sft+dpo", "probe diff"), hook=cfg.hook)
    explorer = cfg.out / "explorer.html"
    cache.run("explorer", {"diff": diff_dir / "diff.safetensors"},
              lambda: {"out": str(write_explorer(diff_dir, explorer))}, [explorer])
    return {"diff_dir": diff_dir, "explorer": explorer, "summary": summary}


BAKED = {"restraint": "dpo-restrained", "ablation": "dpo-ablated"}   # stage prefix -> baked model directory


def restraint_stages(cache: StageCache, cfg: DemoConfig, dpo: Path, diff_dir: Path, dimension: str, *,
                     factor: float, kind: str = "restraint") -> dict:
    """Select the most changed units of `dimension` at `factor`, bake them into a copy of the DPO model, check it.
    kind: "restraint" (the paper's factor) or "ablation" (the same units at the ablation factor)."""
    from rolemrc.intervene import bake, check, select

    spec = cfg.out / f"{kind}.yaml"
    baked = cfg.out / BAKED[kind]

    def choose() -> dict:
        r = select(diff_dir, dimension, method=cfg.method, top_k=cfg.top_k, factor=factor,
                   name=f"{dimension.replace('_', '-')}-{kind}")
        return {"spec": str(r.save(spec)), "units": r.num_units}

    cache.run(f"{kind} select", {"diff": diff_dir / "diff.safetensors", "dimension": dimension, "method": cfg.method,
                                 "top_k": cfg.top_k, "factor": factor}, choose, [spec])
    bake_report = cache.run(f"{kind} bake", {"model": dpo, "spec": spec},
                            lambda: bake(dpo, spec, baked).to_dict(), [baked / "config.json"])
    check_report = cache.run(f"{kind} check", {"model": dpo, "spec": spec, "baked": baked},
                             lambda: check(dpo, spec, baked_dir=baked).to_dict(), [baked / "config.json"])
    return {"spec": spec, "baked": baked, "bake": bake_report, "check": check_report}


def lora_stage(cache: StageCache, cfg: DemoConfig, dpo: Path, spec: Path) -> dict:
    """The restraint as a PEFT LoRA adapter over the DPO model (what vLLM serves)."""
    from rolemrc.intervene.lora import export_lora

    out = cfg.out / "restraint-lora"
    return cache.run("restraint lora", {"model": dpo, "spec": spec},
                     lambda: _jsonable(export_lora(dpo, spec, out).to_dict()),
                     [out / "adapter_model.safetensors"])


def compare_stage(cache: StageCache, cfg: DemoConfig, before: Path, after: Path) -> dict:
    from rolemrc.eval import compare

    out = cfg.out / "eval" / f"compare-{after.name}"   # e.g. compare-dpo-restrained

    def run() -> dict:
        compare(before, after).save(out)
        return json.loads((out / "compare.json").read_text())

    return cache.run(f"eval compare {after.name}", {"a": before / "report.json", "b": after / "report.json"}, run,
                     [out / "compare.json"])


def sweep_stage(cache: StageCache, cfg: DemoConfig, dpo: Path, diff_dir: Path, dimension: str, test: Path) -> dict:
    """The restraint sweep on the DPO model: `cfg.sweep_factors` x `cfg.sweep_top_k` for `dimension`, each cell
    against the baseline and `cfg.sweep_controls` random-unit controls, on `cfg.sweep_items` test cases."""
    from rolemrc.core.io import read_jsonl, write_jsonl
    from rolemrc.sweep import SweepConfig, run_sweep

    out = cfg.out / "sweep"
    items = out / "test.jsonl"
    rows = read_jsonl(test)
    step = max(1, len(rows) / cfg.sweep_items)
    config = SweepConfig(model=str(dpo), diff=str(diff_dir), data=str(items), out=str(out), dimensions=[dimension],
                         method=cfg.method, factors=list(cfg.sweep_factors), top_k=list(cfg.sweep_top_k),
                         controls=cfg.sweep_controls,
                         max_new_tokens=min(48, cfg.max_new_tokens))

    def run() -> dict:
        write_jsonl(items, [rows[int(k * step)] for k in range(min(cfg.sweep_items, len(rows)))])
        summary = run_sweep(config, metrics=SWEEP_METRICS)
        return {"out": str(out), "headline": summary["headline"], "cells": summary["cells"],
                "figures": summary["figures"], "items": sum(1 for _ in items.open())}

    return cache.run("restraint sweep", {"model": dpo, "diff": diff_dir / "diff.safetensors", "test": test,
                                         "config": dataclasses.asdict(config) | {"metrics": SWEEP_METRICS}},
                     run, [out / "sweep.json"])


def _result(result: Any) -> dict:
    return {"out_dir": str(result.out_dir), "metrics": result.metrics, "seconds": round(result.seconds, 1),
            "data": _jsonable(result.data)}


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))
