"""`rolemrc demo`: every stage of the method, offline, cached by input fingerprint.

From the embedded default (`--base embedded`, `make demo`): datagen -> train base -> SFT -> DPO -> eval SFT and DPO ->
probe both (paired) -> diff (McNemar) + explorer -> restraint for the dimension with the largest shift -> bake +
check -> eval after + compare -> restraint sweep (factors x top-k, each against random-unit controls) -> serve and
call with the openai client -> summary.
From a pretrained model (`--base smollm2`, `make demo-real`): the same with LoRA SFT/DPO from that model, its own
eval ("instruct"), an ablation of the same units, the restraint exported as a LoRA adapter, vLLM in the serve
stage where installed, and results.md with every table.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from rolemrc.core.extras import needs
from rolemrc.core.stages import StageCache
from rolemrc.demo.config import EMBEDDED, DemoConfig
from rolemrc.demo.report import results_markdown, verdict_sentence
from rolemrc.demo.serve import serve_stage
from rolemrc.demo.stages import (
    base_model,
    compare_stage,
    data_stage,
    eval_stage,
    lora_stage,
    probe_stages,
    restraint_stages,
    sweep_stage,
    train_stages,
)
from rolemrc.intervene.spec import PAPER_FACTOR
from rolemrc.probe.cli import Hook

__all__ = ["DemoConfig", "register", "run_demo"]
console = Console()


def run_demo(cfg: DemoConfig) -> dict:
    """Run (or reuse) every stage under `cfg.out`; returns the summary also written to out/summary.json
    (and the tables to out/results.md)."""
    cache = StageCache(cfg.out, force=cfg.force, console=console)
    start = base_model(cfg) if cfg.pretrained else None
    data = data_stage(cache, cfg)
    test = data / "test.jsonl"
    models = train_stages(cache, cfg, data, start)
    evals = {"instruct": eval_stage(cache, cfg, "instruct", start, test)} if start is not None else {}
    evals |= {name: eval_stage(cache, cfg, name, models[name], test) for name in ("sft", "dpo")}
    probe = probe_stages(cache, cfg, models, test)
    dimension = probe["summary"]["largest_shift"]
    factors = {"restraint": cfg.factor} | ({"ablation": cfg.ablation} if cfg.ablation is not None else {})
    restraints, effects = {}, {}
    for kind, factor in factors.items():
        r = restraints[kind] = restraint_stages(cache, cfg, models["dpo"], probe["diff_dir"], dimension,
                                                factor=factor, kind=kind)
        name = r["baked"].name
        evals[name] = eval_stage(cache, cfg, name, r["baked"], test)
        comparison = compare_stage(cache, cfg, cfg.out / "eval" / "dpo", cfg.out / "eval" / name)
        label = f"The {kind} ({r['check']['units']} units x {factor:g})"
        effects[kind] = {"factor": factor, "units": r["check"]["units"], "check_verdict": r["check"]["verdict"],
                         "verdicts": comparison["verdicts"], "metrics": comparison["metrics"],
                         "conclusion": verdict_sentence(comparison, r["check"], label)}
    sweep = sweep_stage(cache, cfg, models["dpo"], probe["diff_dir"], dimension, test) if cfg.sweep else None
    restraint = restraints["restraint"]
    lora = lora_stage(cache, cfg, models["dpo"], restraint["spec"]) if cfg.pretrained else None
    summary = {
        "out": str(cfg.out), "base": cfg.base if start is None or str(start) == cfg.base else f"{cfg.base} ({start})",
        "test_cases": sum(1 for _ in test.open()),
        "artifacts": {"data": str(data), **({"model_instruct": str(start)} if start else {}),
                      **{f"model_{k}": str(v) for k, v in models.items()},
                      "probe_diff": str(probe["diff_dir"]), "heatmaps": str(probe["diff_dir"]),
                      "explorer": str(probe["explorer"]),
                      **{f"{k}_spec": str(r["spec"]) for k, r in restraints.items()},
                      **{f"{k}_model": str(r["baked"]) for k, r in restraints.items()},
                      **({"restraint_lora": lora["out_dir"]} if lora else {}),
                      **{f"eval_{k}": v["run"] for k, v in evals.items()},
                      **{f"{k}_comparison": str(cfg.out / "eval" / f"compare-{r['baked'].name}")
                         for k, r in restraints.items()}},
        "eval": {k: {kk: vv for kk, vv in v.items() if kk != "run"} for k, v in evals.items()},
        "largest_shift": {"dimension": dimension, **probe["summary"]["dimensions"][dimension]},
        "restraint": {"units": restraint["check"]["units"], "factor": cfg.factor,
                      "check_verdict": restraint["check"]["verdict"]},
        "restraint_effect": {k: effects["restraint"][k] for k in ("verdicts", "metrics")},
        "restraint_effects": effects,
        "conclusion": effects["restraint"]["conclusion"],
    }
    if sweep:
        summary["artifacts"]["sweep"] = sweep["out"]
        summary["sweep"] = sweep
    if cfg.serve:
        summary["serve"] = serve_stage(cache, cfg, models["dpo"], restraint["spec"], restraint["baked"], test)
    summary["stage_seconds"] = cache.timings
    summary["stages_run"] = cache.ran
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (cfg.out / "results.md").write_text(results_markdown(summary))
    return summary


def register(app: typer.Typer) -> None:
    @app.command("demo")
    @needs("train", "eval", "datagen", "serve", "minilm")
    def demo_cmd(
        out: Path = typer.Option(DemoConfig.out, help="where every artifact goes"),
        base: str = typer.Option(EMBEDDED, help="embedded (train the default base), a registry model such as "
                                                "smollm2 (pulled once into the cache), or a model directory"),
        size: str = typer.Option(None, help="datagen size preset or number of personas (default: per base)"),
        profile: str = typer.Option(None, help="training profile (default: tiny; smollm2 for a pretrained base)"),
        hook: Hook = typer.Option(DemoConfig.hook, help="probe hook point"),
        top_k: int = typer.Option(None, help="units in the restraint (default: 64; 512 for a pretrained base)"),
        factor: float = typer.Option(PAPER_FACTOR, help="restraint factor (the paper's 1 - 1e-6)"),
        ablation: float = typer.Option(None, help="also restrain the same units at this factor and evaluate "
                                                  "(default: none; 0 for a pretrained base)"),
        max_new_tokens: int = typer.Option(None, help="eval generation length (default: 96; 64 for a pretrained base)"),
        serve: bool = typer.Option(True, help="serve the restrained model briefly and call it"),
        sweep: bool = typer.Option(True, help="sweep factors x top-k with random-unit controls"),
        sweep_items: int = typer.Option(None, help="test cases the sweep generates for (default: 72; 48 pretrained)"),
        vllm: bool = typer.Option(None, "--vllm/--no-vllm", help="also serve on vLLM (the restraint as a LoRA adapter) "
                                                               "(default: where vLLM is installed)"),
        force: bool = typer.Option(False, "--force", help="rerun every stage even if its inputs are unchanged"),
    ) -> None:
        """The whole method, offline; a rerun reuses finished stages."""
        cfg = DemoConfig.for_base(base, out=out, size=size, profile=profile, hook=hook, top_k=top_k, factor=factor,
                                  ablation=ablation, max_new_tokens=max_new_tokens, serve=serve, sweep=sweep,
                                  sweep_items=sweep_items, vllm=vllm, force=force)
        summary = run_demo(cfg)
        console.rule("[bold]summary")
        console.print_json(json.dumps({k: v for k, v in summary.items() if k not in ("restraint_effect",
                                                                                    "restraint_effects", "sweep")},
                                      default=str))
        for effect in summary["restraint_effects"].values():
            console.print(f"[bold]{effect['conclusion']}[/bold]")
        if "sweep" in summary:
            console.print(f"[bold]Sweep: {summary['sweep']['headline']}[/bold]")
        console.print(f"everything is under {out}; summary: {out / 'summary.json'}, tables: {out / 'results.md'}")
