"""`rolemrc organism build narration|refusal|null|units` and `rolemrc organism calibrate`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import typer

from rolemrc.core.cli import choice, cli_app
from rolemrc.core.extras import needs
from rolemrc.intervene.budget import BUDGET_OPTIONS, CURVE, GRID_ONE
from rolemrc.organism.calibration_config import PROBE_CASES, QUICK_GRID, QUICK_PROBE_CASES
from rolemrc.organism.config import KINDS, QUICK, OrganismConfig
from rolemrc.probe.cli import Hook

app = cli_app(help="Known-answer organisms (a DPO model with a planted change, and a null one, from an SFT model) and the "
                   "calibration of the method on them.")
DEFAULTS = {f.name: f for f in dataclasses.fields(OrganismConfig)}
OrganismKind = choice(KINDS)
GRID_HELP = f"{GRID_ONE}; default: --per-layer {','.join(map(str, CURVE))} (those below the model's width)"


def _help(name: str) -> str:
    return DEFAULTS[name].metadata["help"]


@app.command("build")
@needs("train", "eval")
def build_cmd(
    kind: OrganismKind = typer.Argument(..., help="narration (role style) or refusal (knowledge boundary): DPO plants "
                                                  "a known change on that dimension; null: DPO on pairs that prefer "
                                                  "nothing in particular; units: narration's change, trained into "
                                                  "known MLP units only (known_units.json)"),
    out: Path = typer.Option(Path("runs/organisms"), "--out", help="organisms folder (shared by every kind; "
                                                                   "a rerun reuses finished stages)"),
    base: str = typer.Option(DEFAULTS["base"].default, help=_help("base")),
    size: str = typer.Option(DEFAULTS["size"].default, help=_help("size")),
    pairs: int = typer.Option(DEFAULTS["pairs"].default, help=_help("pairs")),
    steps: int = typer.Option(DEFAULTS["steps"].default, "--max-steps", help=_help("steps")),
    batch_size: int = typer.Option(DEFAULTS["batch_size"].default, help=_help("batch_size")),
    learning_rate: float = typer.Option(DEFAULTS["learning_rate"].default, help=_help("learning_rate")),
    beta: float = typer.Option(DEFAULTS["beta"].default, help=_help("beta")),
    lora_r: int = typer.Option(DEFAULTS["lora_r"].default, help=_help("lora_r")),
    lora_targets: str = typer.Option(DEFAULTS["lora_targets"].default, help=_help("lora_targets")),
    max_length: int = typer.Option(DEFAULTS["max_length"].default, help=_help("max_length")),
    reply_tokens: int = typer.Option(DEFAULTS["reply_tokens"].default, help=_help("reply_tokens")),
    eval_tokens: int = typer.Option(DEFAULTS["eval_tokens"].default, help=_help("eval_tokens")),
    eval_planted: int = typer.Option(None, help=_help("eval_planted")),
    eval_others: int = typer.Option(None, help=_help("eval_others")),
    known_layers: int = typer.Option(DEFAULTS["known_layers"].default, help=_help("known_layers")),
    known_units: int = typer.Option(DEFAULTS["known_units"].default, help=_help("known_units")),
    seed: int = typer.Option(DEFAULTS["seed"].default, help=_help("seed")),
    quick: bool = typer.Option(False, "--quick", help=f"fewer steps and held-out cases, where not set otherwise ({QUICK})"),
) -> None:
    """Train the organism (LoRA DPO from the SFT model), evaluate SFT and DPO on held-out cases, write
    <out>/<kind>/organism.json and training.html/png."""
    given = {"base": base, "size": size, "pairs": pairs, "steps": steps, "batch_size": batch_size,
             "learning_rate": learning_rate, "beta": beta, "lora_r": lora_r, "lora_targets": lora_targets,
             "max_length": max_length, "reply_tokens": reply_tokens, "eval_tokens": eval_tokens,
             "eval_planted": eval_planted, "eval_others": eval_others, "known_layers": known_layers,
             "known_units": known_units, "seed": seed}
    if quick:
        given |= {k: v for k, v in QUICK.items() if given[k] == DEFAULTS[k].default}
    config = OrganismConfig(kind=kind, out=str(out), **given)
    from rolemrc.organism.build import build_organism

    report = build_organism(config)
    typer.echo(json.dumps({k: report[k] for k in ("headline", "meets_target", "dpo", "figure")}, default=str))


@app.command("calibrate")
@needs("train", "eval")
def calibrate_cmd(
    out: Path = typer.Option(Path("runs/calibration"), "--out", help="folder of every stage (a rerun reuses them)"),
    base: str = typer.Option(DEFAULTS["base"].default, help=_help("base")),
    organisms: Path = typer.Option(None, help="organisms folder (default: OUT/organisms); one `rolemrc organism "
                                              "build` filled with the same settings is reused"),
    quick: bool = typer.Option(False, "--quick", help="organisms with 16 steps and fewer held-out cases; the "
                                           f"frequency and attribution selectors at {QUICK_GRID['per_layer'][0]} units "
                                           "per layer, factor 0, 8 attribution pairs, 24 probe cases"),
    top_k: str = typer.Option(None, help=f"comma-separated global unit counts ({GRID_HELP})"),
    per_layer: str = typer.Option(None, help=f"comma-separated units from each layer ({GRID_HELP})"),
    share: str = typer.Option(None, help=f"comma-separated shares of all units, ranked over them ({GRID_HELP})"),
    probe_cases: int = typer.Option(None, help="cases (datagen pair prompts no organism trained on) the probes read "
                                               f"(default {PROBE_CASES}, {QUICK_PROBE_CASES} with --quick)"),
    hook: Hook = typer.Option("mlp.act", help="hook point the probes, attribution and restraints use"),
    steps: int = typer.Option(None, "--max-steps", help="DPO steps of each organism (default: organism build's)"),
    learning_rate: float = typer.Option(None, help="DPO learning rate of each organism (default: organism build's)"),
    against: list[Path] = typer.Option(None, "--against", help="another calibration folder of the same base (other "
                                                              "settings, e.g. the --quick one beside the full one) the "
                                                              "recommendation must agree with; repeat for more"),
    json_out: Path = typer.Option(None, "--json", help="also write the JSON here"),
) -> None:
    """Planted organisms (each a known change on one dimension) and a null one from the SFT model --base (a
    directory, a pulled model or a hub id), then per selector x budget x factor the share of each planted change a
    restraint undoes (paired CI) against random-unit controls, what it breaks on the other dimensions and the null's
    false-positive rate; writes calibration.json/.md/.html/.png under --out, prints JSON, and ends with the
    recommendation (selector, units per layer, factor) and how sure it is."""
    from rolemrc.intervene.recommendation import RECOMMENDATION
    from rolemrc.organism.calibration import build_and_calibrate
    from rolemrc.organism.calibration_report import recommendation_text
    from rolemrc.sweep.plan import numbers

    overrides = {k: v for k, v in (("steps", steps), ("learning_rate", learning_rate)) if v is not None}
    budgets = {key: numbers(text, BUDGET_OPTIONS[key]) for key, text in
               (("top_k", top_k), ("per_layer", per_layer), ("share", share)) if text is not None}
    result = build_and_calibrate(out, base=base, quick=quick, probe_n=probe_cases, organism_overrides=overrides,
                                 organisms_dir=organisms, hook=hook, budgets=budgets, against=against)
    text = json.dumps(result, indent=1)
    typer.echo(text)
    typer.echo(recommendation_text(result[RECOMMENDATION]), err=True)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(text)
