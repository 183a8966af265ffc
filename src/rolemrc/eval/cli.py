"""`rolemrc eval`: generate, score, run (both), compare, report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from rolemrc.core.cli import LIMIT, ROUNDS, choice, cli_app
from rolemrc.core.errors import InputError
from rolemrc.core.extras import needs, require
from rolemrc.core.placement import MODEL_HELP, DeviceMap, Dtype, device_map_option, device_option, dtype_option
from rolemrc.core.records import first_cases, read_records
from rolemrc.eval.dataset import DATASETS, check_dataset
from rolemrc.eval.generate import GenerateConfig, generate
from rolemrc.eval.judges import JUDGES, JudgeConfig
from rolemrc.eval.metrics import METRICS, MetricConfig, metrics_help, parse_metrics
from rolemrc.intervene.fit import STRICT_HELP

app = cli_app(help="Generate responses, score them (metrics + judge, CIs), compare runs.")


def _generate_config(data: Path, model: str, base_url: str | None, restraint: str | None, strict: bool,
                     extra_body: str | None, max_new_tokens: int, batch_size: int, concurrency: int, dtype: str,
                     device: str, device_map: str | None, dataset: str | None, allow_drift: bool,
                     limit: int | None) -> tuple[list[dict[str, Any]], GenerateConfig]:
    """(test records: the first `limit` of them, GenerateConfig), every input checked before any model loads. The
    dataset check reads the whole file."""
    try:
        body = json.loads(extra_body) if extra_body else {}
    except json.JSONDecodeError as exc:
        raise InputError(f"--extra-body is not JSON: {exc}") from None
    records, _ = read_records(data, "test")
    check = check_dataset(records, dataset, allow_drift=allow_drift)
    if check.get("drift"):
        typer.secho(f"warning: {len(check['drift'])} task counts differ from the {dataset} histogram (--allow-drift)",
                    fg="yellow", err=True)
    config = GenerateConfig(model=model, base_url=base_url, restraint=restraint, strict=strict, extra_body=body,
                            max_new_tokens=max_new_tokens, batch_size=batch_size, concurrency=concurrency, dtype=dtype,
                            device=device, device_map=device_map)   # resolves the model: a hub id may download
    return first_cases(records, limit), config


def _score_configs(out: Path, judge: str, judge_model: str | None, judge_base_url: str | None, judge_concurrency: int,
                   metrics: str, bertscore_model: str | None,
                   bertscore_layer: int | None) -> tuple[JudgeConfig, MetricConfig | None]:
    groups = parse_metrics(metrics)
    metric_config = MetricConfig(groups=groups, bertscore_model=bertscore_model,
                                 bertscore_layer=bertscore_layer) if groups else None
    judge_config = JudgeConfig(name=judge, model=judge_model, base_url=judge_base_url, concurrency=judge_concurrency,
                               cache=out / "judge_cache.sqlite")
    return judge_config, metric_config


def _score(responses: Path, out: Path, configs: tuple[JudgeConfig, MetricConfig | None], rounds: int,
           limit: int | None = None) -> None:
    """Score the responses and write the run folder; `limit`: the `--limit` the responses were generated with."""
    from rolemrc.eval.runs import score  # numpy

    run = score(responses, *configs, rounds=rounds, progress=True)
    if limit is not None:
        run.summary["limit"] = limit
    run.save(out)
    typer.echo((out / "report.md").read_text())
    if run.summary.get("chart", {}).get("png_error"):
        typer.secho(f"warning: {run.summary['chart']['png_error']}", fg="yellow", err=True)


DatasetName = choice(DATASETS)
JudgeName = choice(JUDGES)
GEN = {
    "model": typer.Option(..., help=f"{MODEL_HELP}; with --base-url, the model id there"),
    "base_url": typer.Option(None, help="OpenAI-compatible endpoint, e.g. http://localhost:8000/v1"),
    "restraint": typer.Option(None, help="restraint spec (YAML/JSON) applied as runtime hooks (local models)"),
    "strict": typer.Option(False, "--strict", help=STRICT_HELP),
    "extra_body": typer.Option(None, help='JSON merged into each endpoint request, e.g. \'{"restraint": "mt"}\''),
    "max_new_tokens": typer.Option(256), "batch_size": typer.Option(32, help="local: rows the engine decodes together"),
    "concurrency": typer.Option(8, help="endpoint requests in flight"),
    "dtype": dtype_option(), "device": device_option(), "device_map": device_map_option(),
    "dataset": typer.Option(None, help="check the file against this dataset's published task histogram (rolemrc: "
                            "18 tasks)"),
    "allow_drift": typer.Option(False, "--allow-drift", help="score a file that drifts from --dataset's histogram"),
    "limit": LIMIT,
}
SCORE = {   # `sweep run` and `ab report` take the judge options too
    "judge": typer.Option("rules", help="rules: offline exact verifiers; openai: any compatible endpoint"),
    "judge_model": typer.Option(None, help="the judge model (endpoint judges, e.g. openai)"),
    "judge_base_url": typer.Option(None, help="the judge's OpenAI-compatible base URL (endpoint judges)"),
    "judge_concurrency": typer.Option(8),
    "metrics": typer.Option(",".join(METRICS.names()), help=metrics_help()),
    "bertscore_model": typer.Option(None, help="local encoder directory (default: packaged all-MiniLM-L6-v2)"),
    "bertscore_layer": typer.Option(None, help="encoder layer (default 5 for MiniLM, else the last)"),
    "rounds": typer.Option(ROUNDS, help="bootstrap resamples"),
}


@app.command("generate")
def generate_cmd(data: Path = typer.Option(..., help="test JSONL"), out: Path = typer.Option(..., help="responses JSONL"),
                 model: str = GEN["model"], base_url: str = GEN["base_url"], restraint: str = GEN["restraint"],
                 strict: bool = GEN["strict"],
                 extra_body: str = GEN["extra_body"], max_new_tokens: int = GEN["max_new_tokens"],
                 batch_size: int = GEN["batch_size"], concurrency: int = GEN["concurrency"], dtype: Dtype = GEN["dtype"],
                 device: str = GEN["device"], device_map: DeviceMap = GEN["device_map"],
                 dataset: DatasetName = GEN["dataset"], allow_drift: bool = GEN["allow_drift"],
                 limit: int = GEN["limit"]) -> None:
    """Generate responses (id, task, response, latency, tokens) for a test file."""
    if base_url:
        require("eval", what="`rolemrc eval generate --base-url`")
    generate(*_generate_config(data, model, base_url, restraint, strict, extra_body, max_new_tokens, batch_size, concurrency,
                               dtype, device, device_map, dataset, allow_drift, limit), out=out)
    typer.echo(f"wrote {out}")


@app.command("score")
@needs("eval")
def score_cmd(responses: Path = typer.Argument(..., help="responses JSONL"), out: Path = typer.Option(..., help="run folder"),
              judge: JudgeName = SCORE["judge"], judge_model: str = SCORE["judge_model"],
              judge_base_url: str = SCORE["judge_base_url"], judge_concurrency: int = SCORE["judge_concurrency"],
              metrics: str = SCORE["metrics"], bertscore_model: str = SCORE["bertscore_model"],
              bertscore_layer: int = SCORE["bertscore_layer"], rounds: int = SCORE["rounds"]) -> None:
    """Score responses: reference metrics and the judge, with bootstrap CIs; writes the run folder."""
    _score(responses, out, _score_configs(out, judge, judge_model, judge_base_url, judge_concurrency, metrics,
                                          bertscore_model, bertscore_layer), rounds)


@app.command("run")
@needs("eval")
def run_cmd(data: Path = typer.Option(..., help="test JSONL"), out: Path = typer.Option(..., help="run folder"),
            model: str = GEN["model"], base_url: str = GEN["base_url"], restraint: str = GEN["restraint"],
            strict: bool = GEN["strict"],
            extra_body: str = GEN["extra_body"], max_new_tokens: int = GEN["max_new_tokens"],
            batch_size: int = GEN["batch_size"], concurrency: int = GEN["concurrency"], dtype: Dtype = GEN["dtype"],
            device: str = GEN["device"], device_map: DeviceMap = GEN["device_map"], dataset: DatasetName = GEN["dataset"],
            allow_drift: bool = GEN["allow_drift"], limit: int = GEN["limit"], judge: JudgeName = SCORE["judge"],
            judge_model: str = SCORE["judge_model"],
            judge_base_url: str = SCORE["judge_base_url"], judge_concurrency: int = SCORE["judge_concurrency"],
            metrics: str = SCORE["metrics"], bertscore_model: str = SCORE["bertscore_model"],
            bertscore_layer: int = SCORE["bertscore_layer"], rounds: int = SCORE["rounds"]) -> None:
    """Generate, then score: OUT/responses.jsonl and the reports. Every input is checked before the model loads."""
    configs = _score_configs(out, judge, judge_model, judge_base_url, judge_concurrency, metrics, bertscore_model,
                             bertscore_layer)
    records, config = _generate_config(data, model, base_url, restraint, strict, extra_body, max_new_tokens, batch_size,
                                       concurrency, dtype, device, device_map, dataset, allow_drift, limit)
    generate(records, config, out=out / "responses.jsonl")
    _score(out / "responses.jsonl", out, configs, rounds, limit)


@app.command("compare")
def compare_cmd(run_a: Path = typer.Argument(..., help="run folder A (before)"),
                run_b: Path = typer.Argument(..., help="run folder B (after)"),
                out: Path = typer.Option(None, help="folder for compare.json/.md and the chart (default: print only)"),
                rounds: int = typer.Option(ROUNDS, help="bootstrap resamples (CIs); Monte Carlo sign flips (n > 16)"),
                costliest: bool = typer.Option(False, "--costliest", help="print only the judge dimension B cost most "
                                               "(for a shell variable); its change and CI go to stderr")) -> None:
    """Paired comparison: exact McNemar on verdicts, with a CI of each change; on metrics a paired bootstrap CI and a
    sign-flip permutation p; the dimension B cost most (SFT -> DPO: the cost a restraint should give back)."""
    from rolemrc.eval.compare import compare
    from rolemrc.eval.report import compare_markdown, costliest_lines

    result = compare(run_a, run_b, rounds=rounds)
    if out:
        result.save(out)
    if not costliest:
        typer.echo(compare_markdown(result))
        return
    cost = result.costliest()
    if cost is None:
        raise InputError(f"{run_a} and {run_b} share no judged verdict: no dimension to name")
    typer.echo(costliest_lines(cost)[0].replace("**", ""), err=True)
    typer.echo(cost["dimension"])


@app.command("report")
def report_cmd(runs: list[Path] = typer.Argument(..., help="run folders"),
               out: Path = typer.Option(None, help="folder for table3.md and the chart")) -> None:
    """One Table 3 (metrics + judge dimensions per run) and a chart across runs."""
    from rolemrc.eval.report import table3, write_chart
    from rolemrc.eval.runs import EvalRun

    loaded = [(str(p), EvalRun.load(p).summary) for p in runs]
    text = table3(loaded)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "table3.md").write_text(text + "\n")
        write_chart(loaded, out / "chart")
    typer.echo(text)
