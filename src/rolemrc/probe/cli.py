"""`rolemrc probe collect|attribute|merge|diff|explore`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from typer._click.core import ParameterSource

from rolemrc.core.cli import LIMIT, choice, cli_app, live_choices
from rolemrc.core.hooks import HOOK_POINTS
from rolemrc.core.placement import DEVICE_HELP, MODEL_HELP, DeviceMap, Dtype, device_map_option, device_option, dtype_option
from rolemrc.probe.options import DEFAULT_RESAMPLES, Backend, Rank, Rounding, Tokens
from rolemrc.probe.presets import PRESETS

app = cli_app(help="Top-k unit frequencies per dimension, and their SFT-vs-DPO diff.")

# where and how the models of `collect` and `attribute` load
DEVICE = device_option(DEVICE_HELP + "; launched as several processes, each rank's own GPU")
DEVICE_MAP = device_map_option("spread each model's layers over this process's GPUs (then the CPU) with "
                               "accelerate's big-model placement, instead of --device")
# the inputs of `collect` and `attribute`
Hook = choice(HOOK_POINTS)
PresetName = choice(PRESETS)
HOOK = typer.Option("mlp.act", help="hook point (docs/probe.md)")
RESAMPLES = typer.Option(DEFAULT_RESAMPLES, min=0, help="Poisson bootstrap replicates of the cases counted alongside, so "
                         "`probe diff` and `intervene select` report how stable a selection is (0: off; probe/resample.py)")
MAX_LENGTH = typer.Option(None, min=1, help="keep at most this many tokens per sequence: the prompt's last ones (nearest "
                          "the reply); a reply that alone exceeds it keeps its first ones (default: the context window)")


HookTableCommand = live_choices(hook=HOOK_POINTS)   # --hook: the rows of HOOK_POINTS when the CLI is built


@app.command("collect", cls=HookTableCommand)
def collect_cmd(
    ctx: typer.Context,
    model: list[Path] = typer.Option(..., "--model", help=f"{MODEL_HELP}; repeat it to collect several models paired "
                                     "over the same cases (one paired probe file)"),
    data: Path = typer.Option(..., "--data", help="JSONL records (test, pair or SFT format)"),
    out: Path = typer.Option(..., "--out", help="probe file to write (.safetensors)"),
    preset: PresetName = typer.Option(None, help="named settings (docs/probe.md): rolemrc-code reproduces the RoleMRC "
                                      "authors' analysis; options given beside it override it"),
    hook: Hook = HOOK,
    top_fraction: float = typer.Option(0.2, help="share of units counted as active per observation"),
    top_rounding: Rounding = typer.Option("up", help="top_fraction x width to a unit count: up, or down (the RoleMRC "
                                          "code's int())"),
    tokens: Tokens = typer.Option("last", help="last prompt token, or all prompt tokens"),
    rank: Rank = typer.Option("signed", help="rank by signed value, or by abs"),
    batch_size: int = typer.Option(16, min=1),
    top_cases: int = typer.Option(5, min=0, help="per unit and model, keep the cases that activate it most (their "
                                  "short prompt texts too; the explorer shows them); 0: off"),
    backend: Backend = typer.Option("torch"),
    dimension_field: str = typer.Option(None, help="record field naming the dimension(s), instead of the task taxonomy"),
    generation_prompt: bool = typer.Option(True, help="render the prompt with the template's generation prompt (the "
                                           "RoleMRC code renders it without)"),
    prepend_bos: bool = typer.Option(False, "--prepend-bos", help="put the tokenizer's BOS token before the rendered "
                                     "prompt, as TransformerLens does to a string (the RoleMRC code on Llama)"),
    max_length: int = MAX_LENGTH,
    limit: int = LIMIT,
    resamples: int = RESAMPLES,
    dtype: Dtype = dtype_option(),
    device: str = DEVICE,
    device_map: DeviceMap = DEVICE_MAP,
) -> None:
    """Count how often each unit lands in the top `top_fraction` of its layer, per dimension. With several
    `--model`s, each batch runs through every model and the paired statistics per unit are kept too.
    Under `torchrun --nproc_per_node N -m rolemrc.cli probe collect ...` (or `accelerate launch`) each process
    counts every N-th batch, the counts are summed over the processes, and rank 0 alone writes and prints."""
    from rolemrc.probe.collect import CollectConfig, collect, collect_paired
    from rolemrc.probe.distributed import shard_from_env

    settings = {"hook": hook, "top_fraction": top_fraction, "top_rounding": top_rounding, "tokens": tokens,
                "rank": rank, "batch_size": batch_size, "top_cases": top_cases, "backend": backend,
                "dimension_field": dimension_field, "generation_prompt": generation_prompt, "prepend_bos": prepend_bos,
                "max_length": max_length, "limit": limit, "dtype": dtype, "device": device, "device_map": device_map,
                "resamples": resamples}
    if preset:  # the preset's settings, but for options given on the command line
        chosen = PRESETS.get(preset).settings
        settings = {key: value for key, value in settings.items()
                    if key not in chosen or ctx.get_parameter_source(key) is not ParameterSource.DEFAULT}
    config = CollectConfig.from_preset(preset, **settings) if preset else CollectConfig(**settings)
    probe = collect(model[0], data, config) if len(model) == 1 else collect_paired(model, data, config)
    if shard_from_env().main:
        typer.echo(json.dumps({"out": str(probe.save(out)), **_report(probe)}, indent=1))


def _report(probe: Any) -> dict[str, Any]:
    """What a probe file holds, for the CLI's JSON."""
    from rolemrc.probe.paired import PairedCounts

    counts, extra = (probe.counts[0], {"models": probe.models}) if isinstance(probe, PairedCounts) else (probe, {})
    return {**extra, "cases": counts.cases, "empty_dimensions": counts.empty_dimensions,
            **{key: counts.meta[key] for key in ("preset", "preset_overrides") if counts.meta.get(key)},
            "hook": counts.meta["hook"], "k": int(counts.meta["k"]), "layers": int(counts.meta["layers"]),
            "width": int(counts.meta["width"]), "truncated": int(counts.meta["truncated"]), "resamples": len(probe.resamples)}


@app.command("attribute", cls=HookTableCommand)
def attribute_cmd(
    model: list[Path] = typer.Option(..., "--model", help=f"{MODEL_HELP}; given exactly twice: the reference "
                                     "(SFT) first, then the model tuned from it (DPO; same tokenizer and shape)"),
    pairs: Path = typer.Option(..., "--pairs", help="JSONL preference pairs (prompt, chosen, rejected, task)"),
    out: Path = typer.Option(..., "--out", help="attribution file to write (.safetensors)"),
    hook: Hook = HOOK,
    batch_size: str = typer.Option("auto", help="preference pairs per batch (twice as many sequences); auto: as many as "
                                   "80% of the GPU's free memory holds by rolemrc.probe.memory's cost model (4 on the CPU)"),
    dimension_field: str = typer.Option(None, help="record field naming the dimension(s), instead of the task taxonomy"),
    max_length: int = MAX_LENGTH,
    limit: int = LIMIT,
    resamples: int = RESAMPLES,
    dtype: Dtype = dtype_option(),
    device: str = DEVICE,
    device_map: DeviceMap = DEVICE_MAP,
) -> None:
    """Attribution patching: per unit and dimension, the DPO preference margin's gradient with respect to the unit's
    activation times the unit's SFT -> DPO activation change, summed over every position of each pair's chosen and
    rejected sequence. Positive: the change favours the chosen reply. Under `torchrun --nproc_per_node N -m
    rolemrc.cli probe attribute ...` each process scores every N-th batch and rank 0 alone writes and prints."""
    from rolemrc.probe.attribution import AttributeConfig, attribute
    from rolemrc.probe.distributed import shard_from_env

    config = AttributeConfig(hook=hook, batch_size=batch_size, dimension_field=dimension_field, max_length=max_length,
                             limit=limit, dtype=dtype, device=device, device_map=device_map, resamples=resamples)
    result = attribute(model, pairs, config)
    if shard_from_env().main:
        typer.echo(json.dumps({"out": str(result.save(out)), **_attribution_report(result)}, indent=1))


def _attribution_report(result: Any, top: int = 5) -> dict[str, Any]:
    """What an attribution file holds, with each dimension's `top` units by |mean score|, for the CLI's JSON."""
    import torch

    from rolemrc.probe.ranking import rank_units

    def units(score: torch.Tensor) -> list[dict[str, Any]]:
        flat = rank_units(score, None)[:top].tolist()
        return [{"layer": i // score.shape[1], "unit": i % score.shape[1], "score": score.reshape(-1)[i].item()}
                for i in flat]

    return {"pairs": result.pairs, "empty_dimensions": result.empty_dimensions, "hook": result.meta["hook"],
            "layers": int(result.meta["layers"]), "width": int(result.meta["width"]),
            "truncated": int(result.meta["truncated"]), "resamples": len(result.resamples),
            "batch_size": result.meta.get("batch_size"),
            "peak_memory_gib": result.meta.get("peak_memory_gib") or None, "top": {d: units(s) for d, s in result.scores.items()}}


@app.command("merge")
def merge_cmd(
    probes: list[Path] = typer.Argument(..., help="probe files (single or paired) counted over disjoint cases, or "
                                        "attribution files over disjoint pairs"),
    out: Path = typer.Option(..., "--out", help="merged file to write (.safetensors)"),
) -> None:
    """Sum probe files collected anywhere (shards of the data) into one, equal to collecting all their cases at
    once. Refuses files counted differently (as `diff` does, plus the models and dtype) or sharing a case.
    Attribution files (`probe attribute`) sum the same way; the two kinds do not mix."""
    from rolemrc.probe.attribution import Attribution
    from rolemrc.probe.merge import merge_any

    merged = merge_any(probes)
    report = _attribution_report(merged) if isinstance(merged, Attribution) else _report(merged)
    typer.echo(json.dumps({"out": str(merged.save(out)), "merged": [str(p) for p in probes], **report}, indent=1))


@app.command("diff")
def diff_cmd(
    a: Path = typer.Argument(..., help="probe file A (e.g. SFT), or a paired probe file"),
    b: Path = typer.Argument(None, help="probe file B (e.g. DPO); omitted for a paired probe file"),
    out: Path = typer.Option(..., "--out", help="output directory"),
    model_a: int = typer.Option(0, "--a", help="paired file: index of model A"),
    model_b: int = typer.Option(1, "--b", help="paired file: index of model B"),
    top_n: int = typer.Option(200, help="most changed units per dimension in units.csv/json"),
    fdr: float = typer.Option(0.05, help="Benjamini-Hochberg level for 'significant'"),
    bins: int = typer.Option(64, help="unit bins per layer in the unit heatmaps"),
    figures: bool = typer.Option(True, help="write Plotly HTML + PNG heatmaps"),
) -> None:
    """delta = freq_B - freq_A per dimension and layer, unit tests with BH-FDR, tables and heatmaps.
    A paired file is tested with exact McNemar (tokens=last) or a paired t-test on per-case shares (tokens=all);
    two unpaired files with the two-proportion z-test (tokens=last only). Beside it, from the activation moments, the
    standardized effect (mean_B - mean_A) / pooled SD with a paired t-test on per-case differences (paired files) or
    Welch's t (two tokens=last files). summary.json names both tests."""
    from rolemrc.probe.diff import diff
    from rolemrc.probe.errors import ProbeError
    from rolemrc.probe.report import write_diff
    from rolemrc.probe.resample import stability_lines

    if b is not None and (model_a, model_b) != (0, 1):
        raise ProbeError("--a/--b pick models of one paired probe file; with two probe files, leave them out")
    result = diff(a, b, models=(model_a, model_b))
    summary = write_diff(result, out, top_n=top_n, fdr=fdr, bins=bins, figures=figures)
    typer.echo(json.dumps(summary, indent=1))
    if summary["stability"]:
        typer.echo(f"stability over {len(result.resamples)} resamples of the cases (Jaccard of the units each ranking "
                   "selects per layer):\n" + "\n".join(stability_lines(summary["stability"])), err=True)


@app.command("explore")
def explore_cmd(
    diff: Path = typer.Option(..., "--diff", help="the diff folder written by `rolemrc probe diff`"),
    out: Path = typer.Option(..., "--out", help="HTML file to write"),
    attribution: Path = typer.Option(None, "--attribution", help="an attribution file (`rolemrc probe attribute`) of "
                                     "the same models: adds the attribution selector"),
    max_units: int = typer.Option(512, help="highest scored units embedded per layer and selector (for the preview: "
                                  "per layer and sign)"),
    fdr: float = typer.Option(0.05, help="q threshold for highlighting and for the preview's q < fdr"),
) -> None:
    """Write a self-contained interactive layer explorer (open it in a browser): each selector's ranking
    (frequency, standardized, attribution with --attribution), each unit's top prompts under A and B (from
    `probe collect --top-cases`), and a preview of what `intervene select --method X` picks."""
    from rolemrc.probe.explorer import write_explorer

    path = write_explorer(diff, out, max_units=max_units, fdr=fdr, attribution=attribution)
    typer.echo(json.dumps({"out": str(path), "bytes": path.stat().st_size}))
