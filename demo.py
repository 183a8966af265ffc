"""`rolemrc demo`: every stage on the embedded default, offline, cached by input fingerprint.

datagen (template) -> train base -> SFT -> DPO -> eval SFT and DPO -> probe both (paired) -> diff (McNemar) + explorer ->
restraint for the dimension with the largest shift -> bake + check -> eval before/after + compare ->
serve the restrained model and call it with the openai client -> summary.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from rolemrc.core.stages import StageCache

console = Console()
PAPER_FACTOR = 1 - 1e-6


@dataclasses.dataclass
class DemoConfig:
    """What the demo runs; every field is part of some stage's cache key."""

    out: Path = Path("runs/demo")
    size: str = "small"            # datagen preset
    profile: str = "tiny"          # training profile
    hook: str = "mlp.act"          # probe hook point
    top_k: int = 64                # units in the restraint
    factor: float = PAPER_FACTOR   # the paper's 1 - 1e-6
    max_new_tokens: int = 96       # eval generation
    serve: bool = True
    force: bool = False


def data_stage(cache: StageCache, cfg: DemoConfig) -> Path:
    from rolemrc.datagen.config import DatagenConfig
    from rolemrc.datagen.pipeline import run

    data = cfg.out / "data"
    cache.run("datagen", {"size": cfg.size, "backend": "template", "seed": 0},
              lambda: _jsonable(run(DatagenConfig(out=data, size=cfg.size))),
              [data / f for f in ("sft.jsonl", "pairs.jsonl", "test.jsonl")])
    return data


def train_stages(cache: StageCache, cfg: DemoConfig, data: Path) -> dict[str, Path]:
    from rolemrc.train import BaseTrainConfig, DPOTrainConfig, SFTTrainConfig, make_config, train_base, train_dpo, train_sft

    dirs = {name: cfg.out / name for name in ("base", "sft", "dpo")}
    sft_data, pairs = data / "sft.jsonl", data / "pairs.jsonl"
    stages = [("base", train_base, BaseTrainConfig, {"data": [str(sft_data), str(pairs)]}, [sft_data, pairs]),
              ("sft", train_sft, SFTTrainConfig, {"model": str(dirs["base"]), "data": [str(sft_data)]},
               [dirs["base"], sft_data]),
              ("dpo", train_dpo, DPOTrainConfig, {"model": str(dirs["sft"]), "data": [str(pairs)]}, [dirs["sft"], pairs])]
    for name, fn, cls, kw, inputs in stages:
        config = make_config(cls, profile=cfg.profile, out=str(dirs[name]), **kw)
        settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("out", "progress")}
        cache.run(f"train {name}", {"inputs": inputs, "settings": settings},
                  lambda fn=fn, config=config: _result(fn(config)), [dirs[name] / "config.json"])
    return dirs


def eval_stage(cache: StageCache, cfg: DemoConfig, name: str, model: Path, test: Path) -> dict:
    """Generate on the test set and score (rules judge + every registered reference metric, bootstrap CIs)."""
    from rolemrc.eval import generate, score
    from rolemrc.eval.metrics import METRICS

    run_dir = cfg.out / "eval" / name
    metrics = METRICS.names()

    def run() -> dict:
        items = generate(test, model=str(model), max_new_tokens=cfg.max_new_tokens, batch_size=16)
        score(items, judge="rules", metrics=metrics, progress=True).save(run_dir)
        return {"run": str(run_dir), **headline(run_dir)}

    return cache.run(f"eval {name}", {"model": model, "data": test, "max_new_tokens": cfg.max_new_tokens,
                                      "metrics": metrics}, run, [run_dir / "report.json"])


def headline(run_dir: Path) -> dict:
    """The run's key numbers with 95% CIs: judge AvgWeighted and per-dimension means, metric means."""
    report = json.loads((run_dir / "report.json").read_text())
    judge = report.get("judge_aggregates", {})
    pick = lambda d: {k: round(d[k], 4) for k in ("mean", "lo", "hi") if d.get(k) is not None}  # noqa: E731
    return {"judge_avg_weighted": pick(judge.get("averages", {}).get("AvgWeighted", {})),
            "judge_dimensions": {d: pick(v) for d, v in judge.get("dimensions", {}).items()},
            "metrics": {m: pick(v) for m, v in report.get("metrics", {}).items()},
            "metrics_unavailable": report.get("metrics_unavailable", {})}


def probe_stages(cache: StageCache, cfg: DemoConfig, models: dict[str, Path], test: Path) -> dict:
    """SFT and DPO probed together (one paired file), diffed with the exact McNemar test per unit."""
    from rolemrc.probe import collect_paired, diff, write_diff
    from rolemrc.probe.explorer import write_explorer

    paired = cfg.out / "probe" / "sft-dpo.safetensors"
    cache.run("probe sft+dpo", {"models": [models["sft"], models["dpo"]], "data": test, "hook": cfg.hook},
              lambda: _probe_report(collect_paired([models["sft"], models["dpo"]], test, hook=cfg.hook).save(paired)),
              [paired])
    diff_dir = cfg.out / "diff"
    summary = cache.run("probe diff", {"paired": paired},
                        lambda: write_diff(diff(paired), diff_dir), [diff_dir / "diff.safetensors"])
    explorer = cfg.out / "explorer.html"
    cache.run("explorer", {"diff": diff_dir / "diff.safetensors"},
              lambda: {"out": str(write_explorer(diff_dir, explorer))}, [explorer])
    return {"diff_dir": diff_dir, "explorer": explorer, "summary": summary}


def restraint_stages(cache: StageCache, cfg: DemoConfig, dpo: Path, diff_dir: Path, dimension: str) -> dict:
    """Select the most changed units of `dimension`, bake them into a copy of the DPO model, check it."""
    from rolemrc.intervene import bake, check, select

    spec = cfg.out / "restraint.yaml"
    baked = cfg.out / "dpo-restrained"

    def choose() -> dict:
        r = select(diff_dir, dimension, top_k=cfg.top_k, factor=cfg.factor, name=f"{dimension.replace('_', '-')}-restraint")
        return {"spec": str(r.save(spec)), "units": r.num_units}

    cache.run("restraint select", {"diff": diff_dir / "diff.safetensors", "dimension": dimension, "top_k": cfg.top_k,
                                   "factor": cfg.factor}, choose, [spec])
    bake_report = cache.run("restraint bake", {"model": dpo, "spec": spec},
                            lambda: bake(dpo, spec, baked).to_dict(), [baked / "config.json"])
    check_report = cache.run("restraint check", {"model": dpo, "spec": spec, "baked": baked},
                             lambda: check(dpo, spec, baked_dir=baked).to_dict(), [baked / "config.json"])
    return {"spec": spec, "baked": baked, "bake": bake_report, "check": check_report}


def compare_stage(cache: StageCache, cfg: DemoConfig, before: Path, after: Path) -> dict:
    from rolemrc.eval import compare

    out = cfg.out / "eval" / "compare-restraint"

    def run() -> dict:
        compare(before, after).save(out)
        return json.loads((out / "compare.json").read_text())

    return cache.run("eval compare", {"a": before / "report.json", "b": after / "report.json"}, run,
                     [out / "compare.json"])


def serve_stage(cache: StageCache, cfg: DemoConfig, dpo: Path, spec: Path, baked: Path, test: Path) -> dict:
    """Start `rolemrc serve` on loopback with the DPO model, its registered restraint and the baked copy; ask all
    variants (plain, runtime restraint by name and by extra_body, baked) the first test question
    with the openai client (greedy)."""
    import openai

    from rolemrc.core.io import read_jsonl
    from rolemrc.core.records import prompt_turns
    from rolemrc.intervene import Restraint
    from rolemrc.serve.launch import running_server

    out = cfg.out / "serve"
    name = Restraint.load(spec).name
    config = {"models": {"dpo": {"path": str(dpo.resolve())}, "dpo-restrained": {"path": str(baked.resolve())}},
              "restraints": {name: str(spec.resolve())}, "db": str((out / "ab.sqlite").resolve())}

    def run() -> dict:
        out.mkdir(parents=True, exist_ok=True)
        messages = prompt_turns(read_jsonl(test)[0])
        calls = {"dpo": {}, f"dpo+{name}": {}, "dpo-restrained": {}, "dpo (extra_body restraint)": {"restraint": name}}
        with running_server(config, workdir=out) as server:
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="demo")
            models = [m.id for m in client.models.list().data]
            replies = {label: client.chat.completions.create(
                model=label.split(" ")[0], messages=messages, max_tokens=48, temperature=0,
                extra_body=body or None).choices[0].message.content for label, body in calls.items()}
        result = {"base_url": server.base_url, "models": models, "question": messages[-1]["content"],
                  "replies": replies,
                  "hook_equals_baked": replies[f"dpo+{name}"] == replies["dpo-restrained"]}
        (out / "calls.json").write_text(json.dumps(result, indent=1))
        return result

    return cache.run("serve", {"dpo": dpo, "spec": spec, "baked": baked}, run, [out / "calls.json"])


def verdict_sentence(comparison: dict, check: dict) -> str:
    """One honest sentence: did the restraint change anything measurable (exact McNemar / sign-flip permutation, p < 0.05)?"""
    changed = [f"judge {dim} ({v['a_rate']:.3f} -> {v['b_rate']:.3f}, exact McNemar p={v['p']:.3g})"
               for dim, v in comparison.get("verdicts", {}).items() if v.get("p", 1) < 0.05]
    changed += [f"{name} ({m['diff']:+.4f} [{m['lo']:+.4f}, {m['hi']:+.4f}], sign-flip p={m['p']:.3g})"
                for name, m in comparison.get("metrics", {}).items() if m.get("p", 1) < 0.05]
    flips = sum(v.get("improved", 0) + v.get("worsened", 0) for v in comparison.get("verdicts", {}).values())
    where = f"{check['weight_elements_changed']} weight elements changed, max logit shift " \
            f"{check['hook_vs_original_max_abs']:.2e}"
    if check.get("numerical_noop"):
        return f"The restraint is a numerical no-op at {check['dtype']} (factor rounds to 1): nothing could change."
    if changed:
        return f"The restraint changed, at p < 0.05: {'; '.join(changed)} ({where})."
    return (f"The restraint changed nothing measurable: no judge dimension (McNemar; {flips} verdict flips in all) "
            f"and no reference metric (paired sign-flip test) differs at p < 0.05 ({where}).")


def _probe_report(path: Path) -> dict:
    from rolemrc.probe import load_probe

    paired = load_probe(path)
    counts = paired.counts[0]
    return {"out": str(path), "models": paired.models, "cases": counts.cases, "empty_dimensions": counts.empty_dimensions}


def _result(result: Any) -> dict:
    return {"out_dir": str(result.out_dir), "metrics": result.metrics, "seconds": round(result.seconds, 1),
            "data": _jsonable(result.data)}


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def run_demo(cfg: DemoConfig) -> dict:
    """Run (or reuse) every stage under `cfg.out`; returns the summary also written to out/summary.json."""
    cache = StageCache(cfg.out, force=cfg.force, console=console)
    data = data_stage(cache, cfg)
    test = data / "test.jsonl"
    models = train_stages(cache, cfg, data)
    evals = {name: eval_stage(cache, cfg, name, models[name], test) for name in ("sft", "dpo")}
    probe = probe_stages(cache, cfg, models, test)
    dimension = probe["summary"]["largest_shift"]
    restraint = restraint_stages(cache, cfg, models["dpo"], probe["diff_dir"], dimension)
    evals["dpo-restrained"] = eval_stage(cache, cfg, "dpo-restrained", restraint["baked"], test)
    comparison = compare_stage(cache, cfg, cfg.out / "eval" / "dpo", cfg.out / "eval" / "dpo-restrained")
    summary = {
        "out": str(cfg.out),
        "artifacts": {"data": str(data), **{f"model_{k}": str(v) for k, v in models.items()},
                      "probe_diff": str(probe["diff_dir"]), "heatmaps": str(probe["diff_dir"]),
                      "explorer": str(probe["explorer"]), "restraint_spec": str(restraint["spec"]),
                      "restrained_model": str(restraint["baked"]),
                      **{f"eval_{k}": v["run"] for k, v in evals.items()},
                      "restraint_comparison": str(cfg.out / "eval" / "compare-restraint")},
        "eval": {k: {kk: vv for kk, vv in v.items() if kk != "run"} for k, v in evals.items()},
        "largest_shift": {"dimension": dimension, **probe["summary"]["dimensions"][dimension]},
        "restraint": {"units": restraint["check"]["units"], "factor": cfg.factor,
                      "check_verdict": restraint["check"]["verdict"]},
        "restraint_effect": {"verdicts": comparison["verdicts"], "metrics": comparison["metrics"]},
        "conclusion": verdict_sentence(comparison, restraint["check"]),
    }
    if cfg.serve:
        summary["serve"] = serve_stage(cache, cfg, models["dpo"], restraint["spec"], restraint["baked"], test)
    summary["stage_seconds"] = cache.timings
    summary["stages_run"] = cache.ran
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo_cmd(
        out: Path = typer.Option(DemoConfig.out, help="where every artifact goes"),
        size: str = typer.Option(DemoConfig.size, help="datagen size preset"),
        profile: str = typer.Option(DemoConfig.profile, help="training profile"),
        hook: str = typer.Option(DemoConfig.hook, help="probe hook point"),
        top_k: int = typer.Option(DemoConfig.top_k, help="units in the restraint"),
        factor: float = typer.Option(DemoConfig.factor, help="restraint factor (the paper's 1 - 1e-6)"),
        max_new_tokens: int = typer.Option(DemoConfig.max_new_tokens, help="eval generation length"),
        serve: bool = typer.Option(True, help="serve the restrained model briefly and call it"),
        force: bool = typer.Option(False, help="rerun every stage even if its inputs are unchanged"),
    ) -> None:
        """The whole pipeline on the embedded default, offline; a rerun reuses finished stages."""
        summary = run_demo(DemoConfig(out, size, profile, hook, top_k, factor, max_new_tokens, serve, force))
        console.rule("[bold]summary")
        console.print_json(json.dumps({k: v for k, v in summary.items() if k != "restraint_effect"}, default=str))
        console.print(f"[bold]{summary['conclusion']}[/bold]")
        console.print(f"everything is under {out}; summary: {out / 'summary.json'}")
