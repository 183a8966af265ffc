"""`rolemrc organism build narration|refusal|null|units`, `rolemrc organism calibrate` and `rolemrc organism localize`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import typer

from rolemrc.core.cli import choice, cli_app
from rolemrc.core.extras import needs
from rolemrc.core.placement import Dtype
from rolemrc.intervene.budget import BUDGET_OPTIONS, CURVE, GRID_ONE
from rolemrc.organism.calibration_config import PROBE_CASES, QUICK_GRID, QUICK_PROBE_CASES
from rolemrc.organism.config import KINDS, QUICK, OrganismConfig, option_name
from rolemrc.probe.cli import Hook
from rolemrc.sweep.plan import CONTROLS, Measure

app = cli_app(help="Known-answer organisms (a DPO model with a planted change, and a null one, from an SFT model) and the "
                   "calibration of the method on them.")
DEFAULTS = {f.name: f for f in dataclasses.fields(OrganismConfig)}
OrganismKind = choice(KINDS)
GRID_HELP = f"{GRID_ONE}; default: --per-layer {','.join(map(str, CURVE))} (those below the model's width)"


def _help(name: str) -> str:
    return DEFAULTS[name].metadata["help"]


def setting(name: str, unset: bool = False) -> typer.models.OptionInfo:
    """The option of OrganismConfig's `name` (build and calibrate take the same ones); `unset`: default None, so
    calibrate can tell a setting given from one left to its own defaults."""
    default = None if unset or DEFAULTS[name].default is None else DEFAULTS[name].default
    extra = " (default: organism build's, or --quick's)" if unset else ""
    return typer.Option(default, option_name(name), help=_help(name) + extra)


SETTINGS = tuple(f for f in DEFAULTS if f not in ("kind", "out", "base", "seed"))


def given_settings(values: dict[str, object]) -> dict[str, object]:
    """The organism settings among a command's arguments that were given (not None)."""
    return {k: values[k] for k in SETTINGS if values.get(k) is not None}


@app.command("build")
@needs("train", "eval")
def build_cmd(
    kind: OrganismKind = typer.Argument(..., help="narration (role style) or refusal (knowledge boundary): DPO plants "
                                                  "a known change on that dimension; null: DPO on pairs that prefer "
                                                  "nothing in particular; units: narration's change, trained into "
                                                  "known MLP units only (known_units.json)"),
    out: Path = typer.Option(Path("runs/organisms"), "--out", help="organisms folder (shared by every kind; "
                                                                   "a rerun reuses finished stages)"),
    base: str = setting("base"),
    size: str = setting("size"),
    pairs: int = setting("pairs"),
    steps: int = setting("steps"),
    batch_size: int = setting("batch_size"),
    learning_rate: float = setting("learning_rate"),
    beta: float = setting("beta"),
    sft_weight: float = setting("sft_weight"),
    lora_r: int = setting("lora_r"),
    lora_targets: str = setting("lora_targets"),
    max_length: int = setting("max_length"),
    reply_tokens: int = setting("reply_tokens"),
    eval_tokens: int = setting("eval_tokens"),
    eval_planted: int = setting("eval_planted"),
    eval_others: int = setting("eval_others"),
    known_layers: int = setting("known_layers"),
    known_units: int = setting("known_units"),
    dtype: Dtype = setting("dtype"),
    seed: int = setting("seed"),
    quick: bool = typer.Option(False, "--quick", help=f"fewer steps, where not set otherwise ({QUICK})"),
) -> None:
    """Train the organism (LoRA DPO from the SFT model), evaluate SFT and DPO on held-out cases, write
    <out>/<kind>/organism.json and training.html/png."""
    given = {k: v for k, v in locals().items() if k in SETTINGS}
    if quick:
        given |= {k: v for k, v in QUICK.items() if given[k] == DEFAULTS[k].default}
    config = OrganismConfig(kind=kind, out=str(out), base=base, seed=seed, **given)
    from rolemrc.organism.build import build_organism

    report = build_organism(config)
    typer.echo(json.dumps({k: report[k] for k in ("headline", "meets_target", "dpo", "figure")}, default=str))


@app.command("calibrate")
@needs("train", "eval")
def calibrate_cmd(
    out: Path = typer.Option(Path("runs/calibration"), "--out", help="folder of every stage (a rerun reuses them)"),
    base: str = setting("base"),
    organisms: Path = typer.Option(None, help="organisms folder (default: OUT/organisms; with several --seeds, one "
                                              "seed-S folder per seed); one `rolemrc organism build` filled with the "
                                              "same settings is reused"),
    kinds: list[str] = typer.Option(None, "--kind", help=f"organism kinds to build and calibrate on, repeatable or a "
                                                         f"comma list of: {', '.join(KINDS)} (default: every kind)"),
    seeds: int = typer.Option(1, min=1, help="organisms of each kind, built with seeds --seed, --seed + 1, ...; each "
                                             "seed draws its own pairs, training order, probe cases and controls"),
    seed: int = setting("seed"),
    retries: int = typer.Option(1, min=0, help="rebuilds, with the next seeds, of an organism that misses its target "
                                               "(one that still misses is reported and left out)"),
    quick: bool = typer.Option(False, "--quick", help="organisms with 16 steps; the "
                                           f"frequency and attribution selectors at {QUICK_GRID['per_layer'][0]} units "
                                           "per layer, factor 0, 8 attribution pairs, 24 probe cases"),
    top_k: str = typer.Option(None, help=f"comma-separated global unit counts ({GRID_HELP})"),
    per_layer: str = typer.Option(None, help=f"comma-separated units from each layer ({GRID_HELP})"),
    share: str = typer.Option(None, help=f"comma-separated shares of all units, ranked over them ({GRID_HELP})"),
    controls: int = typer.Option(None, min=1, help=f"random-unit controls per cell, matched on activation magnitude "
                                                   f"(default {CONTROLS})"),
    probe_cases: int = typer.Option(None, min=1, help="cases (datagen pair prompts no organism trained on) the probes "
                                                      f"read (default {PROBE_CASES}, {QUICK_PROBE_CASES} with --quick)"),
    hook: Hook = typer.Option("mlp.act", help="hook point the probes, attribution and restraints use"),
    measure: Measure = typer.Option("kl", help="how each cell is scored, as `sweep run --measure`: kl, one "
                                          "teacher-forced forward pass per case, the share of the DPO model's KL to "
                                          "the SFT model undone on the SFT model's own replies; judge, the rules "
                                          "judge on generated replies"),
    frontier: bool = typer.Option(False, "--frontier", help="also draw each planted organism's restraint frontier: "
                                  "every kind (scale, patch, reverts, directions) against controls of its own kind, "
                                  "sized by KL on neutral texts; a units organism's known units as the ceiling"),
    size: str = setting("size", unset=True),
    pairs: int = setting("pairs", unset=True),
    steps: int = setting("steps", unset=True),
    batch_size: int = setting("batch_size", unset=True),
    learning_rate: float = setting("learning_rate", unset=True),
    beta: float = setting("beta", unset=True),
    sft_weight: float = setting("sft_weight", unset=True),
    lora_r: int = setting("lora_r", unset=True),
    lora_targets: str = setting("lora_targets", unset=True),
    max_length: int = setting("max_length", unset=True),
    reply_tokens: int = setting("reply_tokens", unset=True),
    eval_tokens: int = setting("eval_tokens", unset=True),
    eval_planted: int = setting("eval_planted", unset=True),
    eval_others: int = setting("eval_others", unset=True),
    known_layers: int = setting("known_layers", unset=True),
    known_units: int = setting("known_units", unset=True),
    dtype: Dtype = setting("dtype"),
    against: list[Path] = typer.Option(None, "--against", help="another calibration folder of the same base (other "
                                                              "settings, e.g. the --quick one beside the full one) the "
                                                              "recommendation must agree with; repeat for more"),
    ray: str = typer.Option(None, "--ray", help="host:port of a running Ray cluster (`ray start --head` prints it) to "
                                                "run each seed as a task on (the `ray` extra; the folders must be on a "
                                                "filesystem its nodes share); default: in this process"),
    json_out: Path = typer.Option(None, "--json", help="also write the JSON here"),
) -> None:
    """Planted organisms (each a known change on one dimension) and a null one from the SFT model --base (a
    directory, a pulled model or a hub id), then per selector x budget x factor the share of each planted change a
    restraint undoes (paired CI) against random-unit controls, what it breaks on the other dimensions and the null's
    false-positive rate; writes calibration.json/.md/.html/.png under --out, prints JSON, and ends with the
    recommendation (selector, units per layer, factor) and how sure it is. Every setting of `organism build` is an
    option here too."""
    from rolemrc.intervene.recommendation import RECOMMENDATION
    from rolemrc.organism.calibration import build_and_calibrate
    from rolemrc.organism.calibration_report import recommendation_text
    from rolemrc.sweep.plan import numbers

    overrides = given_settings(locals())
    budgets = {key: numbers(text, BUDGET_OPTIONS[key]) for key, text in
               (("top_k", top_k), ("per_layer", per_layer), ("share", share)) if text is not None}
    grid = {"measure": measure, "frontier": frontier, **({"controls": controls} if controls else {})}
    result = build_and_calibrate(out, base=base, quick=quick, probe_n=probe_cases, organism_overrides=overrides,
                                 organisms_dir=organisms, hook=hook, budgets=budgets, against=against,
                                 kinds=[k for text in kinds or KINDS for k in text.split(",") if k],
                                 seeds=list(range(seed, seed + seeds)), ray=ray, grid=grid,
                                 retries=retries)
    text = json.dumps(result, indent=1)
    typer.echo(text)
    typer.echo(recommendation_text(result[RECOMMENDATION]), err=True)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(text)


@app.command("localize")
@needs("train", "eval")
def localize_cmd(
    out: Path = typer.Option(Path("runs/localize"), "--out", help="folder of every stage, one seed-S folder per seed "
                                                                  "(a rerun reuses them)"),
    base: str = setting("base"),
    seeds: int = typer.Option(3, min=1, help="units organisms, built with seeds --seed, --seed + 1, ...; each draws "
                                             "its own S, pairs, training order and probe cases"),
    seed: int = setting("seed"),
    quick: bool = typer.Option(False, "--quick", help=f"organisms with {QUICK['steps']} steps, as calibrate --quick's"),
    probe_cases: int = typer.Option(PROBE_CASES, min=1, help="cases of the planted dimension (datagen pair prompts the "
                                                             "organism did not train on) the probes read"),
    hook: Hook = typer.Option("mlp.act", help="hook point the probes and attribution read (an MLP one: S is MLP units)"),
    attribution_pairs: int = typer.Option(16, min=1, help="organism pairs the attribution selector runs over"),
    size: str = setting("size", unset=True),
    pairs: int = setting("pairs", unset=True),
    steps: int = setting("steps", unset=True),
    batch_size: int = setting("batch_size", unset=True),
    learning_rate: float = setting("learning_rate", unset=True),
    beta: float = setting("beta", unset=True),
    sft_weight: float = setting("sft_weight", unset=True),
    max_length: int = setting("max_length", unset=True),
    reply_tokens: int = setting("reply_tokens", unset=True),
    eval_tokens: int = setting("eval_tokens", unset=True),
    eval_planted: int = setting("eval_planted", unset=True),
    eval_others: int = setting("eval_others", unset=True),
    known_layers: int = setting("known_layers", unset=True),
    known_units: int = setting("known_units", unset=True),
    dtype: Dtype = setting("dtype"),
    json_out: Path = typer.Option(None, "--json", help="also write the JSON here"),
) -> None:
    """Where a DPO change lives, checked on a known answer: per seed a units organism (DPO trained into known MLP
    units S only, from the SFT model --base), probed as `organism calibrate` probes, and every selector's ranking of
    all units scored against S (AUROC, precision at |S|, recall at 4|S|), with intervals over seeds. Cheaper than
    the calibration: no restraint grid. Writes detection.json/.md/.html/.png under --out and prints the JSON."""
    from rolemrc.organism.calibration_config import ORGANISM_SETTINGS, CalibrationConfig
    from rolemrc.organism.localize import known_detection

    settings = {**ORGANISM_SETTINGS, **(QUICK if quick else {}), **given_settings(locals())}
    config = CalibrationConfig(out=str(out), hook=hook, attribution_pairs=attribution_pairs)
    result = known_detection(out, list(range(seed, seed + seeds)), config, settings=settings, base=base,
                             probe_n=probe_cases)
    text = json.dumps({k: result[k] for k in ("headline", "detection", "figure")}, indent=1)
    typer.echo(text)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(text)
