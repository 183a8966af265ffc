"""`rolemrc intervene select|bake|lora|check` (and `sweep`, mounted here by `rolemrc.cli` from `rolemrc.sweep.cli`)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from rolemrc.core.cli import choice, cli_app, live_choices
from rolemrc.core.hooks import HOOK_POINTS
from rolemrc.core.placement import MODEL_HELP, DeviceMap, Dtype, device_map_option, device_option, dtype_option
from rolemrc.core.taxonomy import DIMENSIONS
from rolemrc.intervene.budget import BUDGET_HELP, BUDGET_OPTIONS, Budget
from rolemrc.intervene.fit import STRICT_HELP
from rolemrc.intervene.kinds import CONTRASTS, SELECTED_KINDS
from rolemrc.intervene.spec import PAPER_FACTOR, REVERT_SCOPES
from rolemrc.probe.options import Direction
from rolemrc.probe.selectors import SELECTORS, selectors_help


def brief(report: dict) -> dict:
    """A bake or LoRA report as printed: the restraint summarised (its unit ids are in the spec and in the output's
    rolemrc.json), everything else as is."""
    from rolemrc.intervene.spec import Restraint

    return {**report, "restraint": Restraint.from_dict(report["restraint"]).summary()}


Method = choice(SELECTORS)
SelectedKind = choice(SELECTED_KINDS)
Contrast = choice(CONTRASTS)
Hook = choice(HOOK_POINTS)
RevertScope = choice(REVERT_SCOPES[:2])   # --method: the selectors registered when the CLI is built (`live_choices`)
app = cli_app(help="Restraints: select units from a diff, bake them or export them as LoRA, check them, sweep a grid of them.")


@app.command("select", cls=live_choices(method=SELECTORS))
def select_cmd(
    diff: Path = typer.Option(..., "--diff", help="the selector's input: a diff directory (or its "
                              "diff.safetensors); for --method attribution, an attribution file"),
    dimension: str = typer.Option(..., help=f"a dimension of the diff: {' | '.join(DIMENSIONS)}, or your own"),
    method: Method = typer.Option(None, "--method", help=f"unit selector, named (no default; or --calibration). "
                                    f"{selectors_help()}"),
    factor: float = typer.Option(None, help="scale of the selected units, named (no default; or --calibration): 0 "
                                            f"ablates; {PAPER_FACTOR:.10g} is the paper's (a no-op in bf16/fp16)"),
    calibration: Path = typer.Option(None, "--calibration", help="a calibration folder (`rolemrc organism calibrate`) "
                                     "or its calibration.json: its recommendation supplies method, budget and factor"),
    out: Path = typer.Option(..., "--out", help="spec file to write (.yaml or .json)"),
    layers: str = typer.Option(None, help="e.g. 12-31 or 3,5,7-9 (default: all)"),
    top_k: int = typer.Option(None, help=BUDGET_HELP["top_k"]),
    per_layer: int = typer.Option(None, help=BUDGET_HELP["per_layer"]),
    share: float = typer.Option(None, help=BUDGET_HELP["share"]),
    fdr: float = typer.Option(None, help=BUDGET_HELP["fdr"]),
    direction: Direction = typer.Option("both", help="up: more active under B; down: less; both"),
    name: str = typer.Option(None, help="restraint name (default: <dimension>-restraint)"),
    kind: SelectedKind = typer.Option("scale", "--kind", help="scale the units (by --factor); patch them to their mean "
                                      "activation under the SFT model (the diff's A side, or --means); revert their "
                                      "weights toward the SFT model by --alpha"),
    alpha: float = typer.Option(None, help="--kind revert: how far toward the SFT model, in [0, 1]"),
    means: Path = typer.Option(None, help="--kind patch: the diff whose A side's mean activations the units are set "
                               "to (default: --diff, when it is a diff)"),
) -> None:
    """Write a restraint spec for the units of one dimension a selector ranks highest: method, budget and factor
    named, or taken from a calibration's recommendation (docs/calibration.md says what each selector did there).
    The JSON's `stability`: how alike this selection is across the input's resamples (Jaccard, beside chance; a table
    on stderr), null for an input without resamples."""
    from rolemrc.intervene.select import select
    from rolemrc.intervene.stability import selection_stability
    from rolemrc.probe.resample import stability_lines

    r = select(diff, dimension, method=method, factor=factor, calibration=calibration, top_k=top_k,
               per_layer=per_layer, share=share, fdr=fdr, layers=layers, direction=direction, name=name, kind=kind,
               alpha=alpha, means=means)
    r.save(out)
    budget = next(Budget(kind, r.source[kind]) for kind in BUDGET_OPTIONS if kind in r.source)
    stability = selection_stability(diff, dimension, r.source["method"], [budget], layers=layers, direction=direction)
    typer.echo(json.dumps({"out": str(out), "method": r.source["method"], **r.summary(),
                           "stability": stability[0] if stability else None}))
    if stability:   # null without resamples in the input (probed or attributed with --resamples 0)
        typer.echo("\n".join(stability_lines(stability)), err=True)


def check_contrast(contrast: str, given: dict[str, Path | str | None], dimension: str | None) -> None:
    """One error naming what `intervene direction --contrast` reads and what is missing or not its (before anything
    is read)."""
    from rolemrc.intervene.spec import RestraintError

    reads = {"dpo-sft": ("--diff", "--dimension"), "chosen-rejected": ("--model", "--pairs", "--hook")}[contrast]
    missing = [o for o in reads if o != "--hook" and {**given, "--dimension": dimension}[o] is None]
    foreign = [o for o, value in given.items() if value is not None and o not in reads]
    if missing or foreign:
        raise RestraintError(f"--contrast {contrast} reads {', '.join(reads)}" + "".join(
            f"; {what}: {', '.join(options)}" for what, options in (("missing", missing), ("not its", foreign)) if options))


@app.command("direction", cls=live_choices(hook=HOOK_POINTS))
def direction_cmd(
    contrast: Contrast = typer.Option(CONTRASTS[0], "--contrast", help="what the direction is the difference of: "
                                      "dpo-sft, the paired probe's mean activations DPO - SFT (--diff); "
                                      "chosen-rejected, --model's mean activations over each preference pair's chosen "
                                      "reply minus its rejected one (--pairs), each side read as the mean over its "
                                      "reply's tokens (the prompt is shared, so its last token cannot tell them apart)"),
    diff: Path = typer.Option(None, "--diff", help="dpo-sft: a diff of probe files collected with moments "
                              "(`rolemrc probe diff`)"),
    model: Path = typer.Option(None, "--model", help=f"chosen-rejected: the model run on the pairs (the DPO model, or "
                               f"another): {MODEL_HELP}"),
    pairs: Path = typer.Option(None, "--pairs", help="chosen-rejected: JSONL preference pairs (prompt, chosen, "
                               "rejected, task)"),
    dimension: str = typer.Option(None, help=f"a dimension: {' | '.join(DIMENSIONS)}, or your own; dpo-sft: of the "
                                  "diff (needed); chosen-rejected: only its pairs (default: every pair)"),
    out: Path = typer.Option(..., "--out", help="spec file to write (.yaml or .json)"),
    hook: Hook = typer.Option(None, help="chosen-rejected: the hook point (default mlp.act, as probe collect's; "
                              "mlp.post or mlp.out bake on a gated MLP); dpo-sft: the diff's"),
    layers: str = typer.Option(None, help="e.g. 12-31 or 3,5,7-9 (default: all)"),
    top_layers: int = typer.Option(None, min=1, help="only the N of those layers where the direction is longest"),
    name: str = typer.Option(None, help="restraint name (default: <dimension>-direction)"),
    batch_size: int = typer.Option(8, min=1, help="chosen-rejected: preference pairs per batch (twice as many "
                                   "sequences)"),
    dtype: Dtype = dtype_option(),
    device: str = device_option(),
) -> None:
    """Write a direction restraint: per layer a difference of mean activations at a hook point, normalised, projected
    out of it (Arditi et al.'s ablation, per layer): DPO - SFT on the dimension's cases (a diff), or chosen - rejected
    replies of one model over preference pairs."""
    from rolemrc.intervene.kinds import direction_restraint, pair_direction_restraint

    check_contrast(contrast, {"--diff": diff, "--model": model, "--pairs": pairs, "--hook": hook}, dimension)
    if contrast == CONTRASTS[0]:
        r = direction_restraint(diff, dimension, layers=layers, top_layers=top_layers, name=name)
    else:
        r = pair_direction_restraint(model, pairs, dimension=dimension, layers=layers, top_layers=top_layers, name=name,
                                     hook=hook or "mlp.act", batch_size=batch_size, dtype=dtype, device=device)
    r.save(out)
    typer.echo(json.dumps({"out": str(out), **r.summary()}))


@app.command("revert")
def revert_cmd(
    reference: str = typer.Option(..., "--reference", help=f"the checkpoint to revert toward (the SFT model): {MODEL_HELP}"),
    alpha: float = typer.Option(..., help="how far toward it, in [0, 1] (1: its weights)"),
    scope: RevertScope = typer.Option(..., "--scope", help="model: every weight; layers: the blocks of --layers (a "
                                      "unit-level revert: `intervene select --kind revert`)"),
    out: Path = typer.Option(..., "--out", help="spec file to write (.yaml or .json)"),
    layers: str = typer.Option(None, help="--scope layers: e.g. 3-5"),
    name: str = typer.Option(None, help="restraint name (default: revert-<scope>-<alpha>)"),
) -> None:
    """Write a weight revert: the model's weights moved toward --reference by --alpha (Lin et al.'s interpolation;
    alpha 1 over the model is task arithmetic's negated fine-tuning delta). It is baked, not hooked."""
    from rolemrc.intervene.kinds import revert_restraint

    r = revert_restraint(reference, alpha, scope, layers=layers, name=name)
    r.save(out)
    typer.echo(json.dumps({"out": str(out), **r.summary()}))


@app.command("bake")
def bake_cmd(
    model: Path = typer.Option(..., "--model", help=f"source model: {MODEL_HELP}"),
    spec: Path = typer.Option(..., "--restraint", help="restraint spec at a hook point that bakes: "
                              + " | ".join(name for name, point in HOOK_POINTS.items() if point.fold)),
    out: Path = typer.Option(..., "--out", help="output HF directory"),
    dtype: Dtype = dtype_option("dtype to write (each scaled slice computed in float32); auto: the checkpoint's own "
                                "(config.json), so a bf16 checkpoint stays bf16"),
    device: str = device_option("where to fold: cpu, cuda, cuda:1, ... (auto: cuda if available)"),
    strict: bool = typer.Option(False, "--strict", help=STRICT_HELP),
) -> None:
    """Fold the restraint into the weights and write a standard HF checkpoint."""
    from rolemrc.intervene.bake import bake

    report = bake(model, spec, out, dtype, device=device, strict=strict)
    typer.echo(json.dumps(brief(report.to_dict()), indent=1))
    if report.numerical_noop:
        typer.secho(f"NUMERICAL NO-OP: no weight element changes at {report.dtype}", fg=typer.colors.YELLOW, err=True)


@app.command("lora")
def lora_cmd(
    model: Path = typer.Option(..., "--model", help=f"source model: {MODEL_HELP}"),
    spec: Path = typer.Option(..., "--restraint", help="restraint spec: a scale or direction at a hook point that "
                              "exports as LoRA ("
                              + " | ".join(name for name, point in HOOK_POINTS.items() if point.fold and point.lora)
                              + "), or a revert whose change from its reference is low-rank"),
    out: Path = typer.Option(..., "--out", help="output PEFT adapter directory"),
    rank: int = typer.Option(None, help="LoRA rank (default: the smallest vLLM rank that holds the largest layer's "
                             "units, or a revert's largest numerical rank; a revert above it is refused)"),
    strict: bool = typer.Option(False, "--strict", help=STRICT_HELP),
) -> None:
    """Export the restraint as an exact PEFT LoRA adapter (B @ A = the bake's weight change)."""
    from rolemrc.intervene.lora import export_lora

    typer.echo(json.dumps(brief(export_lora(model, spec, out, rank=rank, strict=strict).to_dict()), indent=1))


@app.command("check")
def check_cmd(
    model: Path = typer.Option(..., "--model", help=f"source model: {MODEL_HELP}"),
    spec: Path = typer.Option(..., "--restraint", help="restraint spec"),
    baked: Path = typer.Option(None, "--baked", help="baked directory to compare with the runtime hook"),
    dtype: Dtype = dtype_option("dtype to run and count changes at; auto: the checkpoint's own (config.json), on any "
                                "device"),
    device: str = device_option(),
    device_map: DeviceMap = device_map_option(),
    strict: bool = typer.Option(False, "--strict", help=STRICT_HELP),
) -> None:
    """Hook vs baked logits, weight elements changed at the dtype, and a no-op verdict."""
    from rolemrc.intervene.check import check

    report = check(model, spec, baked_dir=baked, dtype=dtype, device=device, device_map=device_map, strict=strict)
    typer.echo(json.dumps(report.to_dict(), indent=1))
    typer.secho(report.verdict, fg=typer.colors.YELLOW if report.numerical_noop else typer.colors.GREEN, err=True)
