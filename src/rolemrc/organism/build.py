"""Building an organism: datagen -> the SFT model's own replies -> edited pairs -> LoRA DPO -> held-out eval of SFT
and DPO -> organism.json and a figure. Every stage is cached under the organisms folder; every kind shares the data,
the held-out cases and the SFT model's eval (narration and null share the replies too), so they differ in the pairs.

    out/data/                 datagen (template backend): pairs.jsonl gives the prompts, test.jsonl the held-out cases
    out/replies.jsonl         the SFT model's greedy replies to pair prompts sampled over every task
    out/replies-<dim>.jsonl   ... over the tasks of one dimension (for a kind whose recipe wants its own prompts)
    out/heldout.jsonl         eval_planted cases of each planted dimension + eval_others per other one (test personas)
    out/eval/sft/             the SFT model's eval run (rules judge)
    out/<kind>/pairs.jsonl    the organism's pairs; out/<kind>/dpo/ its merged DPO model
    out/<kind>/eval/          the DPO model's eval run, and compare/ (exact McNemar per dimension against SFT)
    out/<kind>/organism.json  what it is, how it trained, what moved; training.html/png
    out/units/known_units.json  the units organism's known units S (layer -> units; known.py), and in organism.json
                              with the check that S carries its change (carrier.py)
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

from rolemrc.core.io import read_jsonl, write_json, write_jsonl
from rolemrc.core.stages import StageCache
from rolemrc.core.taxonomy import DIMENSIONS, dimensions_for_task
from rolemrc.organism.config import KNOWN, NULL, PLANTED_DIMENSIONS, OrganismConfig, OrganismError
from rolemrc.organism.pairs import RECIPES, null_pairs, sample_prompts

TARGET_SHIFT = 0.3     # the planted dimension must move at least this much ...
TARGET_P = 0.01        # ... with exact McNemar p below this, every other dimension inside the SFT model's 95% CI
GENERATED = "generated.jsonl"   # an organism eval's cached generations (its verdicts are scored anew each build)
STILL_P = 0.05         # where that CI has no width, "inside" means not moved at exact McNemar p below this


def build_organism(config: OrganismConfig, *, cache: StageCache | None = None) -> dict[str, Any]:
    """Build (or reuse) the organism `config.kind` under `config.out`; returns organism.json's content."""
    from rolemrc.models.pull import model_dir

    root = Path(config.out)
    cache = cache or StageCache(root)
    sft = model_dir(config.base)
    data = data_stage(cache, root, config)
    heldout = _heldout_stage(cache, root, data, config)
    sft_eval = _eval_stage(cache, root / "eval" / "sft", "eval sft", sft, heldout, config)
    recipe = RECIPES[config.pairs_kind]
    replies = _replies_stage(cache, root, sft, data, config, config.dimension if recipe.own_dimension else None)
    folder = root / config.kind
    pairs = _pairs_stage(cache, folder, replies, config)
    known = _known_stage(cache, folder, sft, config) if config.kind == KNOWN else None
    dpo = _train_stage(cache, folder, sft, pairs, config, known)
    dpo_eval = _eval_stage(cache, folder / "eval" / "dpo", f"{config.kind} eval dpo", folder / "dpo", heldout, config)
    report = organism_report(config, sft, folder, sft_eval, dpo_eval, dpo)
    if known is not None:
        report |= {"known_units": json.loads(known.read_text()),
                   "carrier": _carrier_stage(cache, folder, sft, known, heldout, config)}
    report["figure"] = training_figure(report, folder)
    write_json(folder / "organism.json", report)
    return report


def data_stage(cache: StageCache, root: Path, config: OrganismConfig) -> Path:
    """The datagen stage every organism build starts with (`config.size`, the template backend, seed 0), cached in
    `cache`: `root`/data with pairs.jsonl and test.jsonl."""
    from rolemrc.datagen.config import DatagenConfig
    from rolemrc.datagen.pipeline import run

    data = root / "data"
    cache.run("datagen", {"size": config.size, "backend": "template", "seed": 0},
              lambda: json.loads(json.dumps(run(DatagenConfig(out=data, size=config.size)), default=str)),
              [data / f for f in ("pairs.jsonl", "test.jsonl")])
    return data


def heldout_cases(test: list[dict[str, Any]], others: int | None, seed: int,
                  planted: int | None = None) -> list[dict[str, Any]]:
    """Up to `planted` cases of each planted dimension and up to `others` of each other dimension (all when None),
    drawn with `seed`, in the test file's order."""
    rng = random.Random(seed)
    by_dim: dict[str, list[int]] = defaultdict(list)
    for k, case in enumerate(test):
        for dim in dimensions_for_task(case.get("task")):
            by_dim[dim].append(k)
    keep: set[int] = set()
    for dim in PLANTED_DIMENSIONS:   # a case kept for one planted dimension counts toward another's cap
        rows = [k for k in by_dim[dim] if k not in keep]
        room = len(rows) if planted is None else max(0, planted - (len(by_dim[dim]) - len(rows)))
        keep |= set(rng.sample(rows, min(room, len(rows))))
    mine = {k for dim in PLANTED_DIMENSIONS for k in by_dim[dim]}
    for dim in DIMENSIONS:
        if dim not in PLANTED_DIMENSIONS:
            rows = [k for k in by_dim[dim] if k not in mine]
            keep |= set(rows if others is None else rng.sample(rows, min(others, len(rows))))
    return [case for k, case in enumerate(test) if k in keep]


def _heldout_stage(cache: StageCache, root: Path, data: Path, config: OrganismConfig) -> Path:
    out = root / "heldout.jsonl"
    cache.run("held-out cases", {"test": data / "test.jsonl", "others": config.eval_others,
                                 "planted": config.eval_planted, "dimensions": PLANTED_DIMENSIONS, "seed": config.seed},
              lambda: {"cases": write_jsonl(out, heldout_cases(read_jsonl(data / "test.jsonl"), config.eval_others,
                                                               config.seed, config.eval_planted))}, [out])
    return out


def _replies_stage(cache: StageCache, root: Path, sft: Path, data: Path, config: OrganismConfig,
                   dimension: str | None) -> Path:
    """The SFT model's replies to `config.pairs` pair prompts spread over every task, or over `dimension`'s tasks."""
    from rolemrc.eval import generate

    out = root / ("replies.jsonl" if dimension is None else f"replies-{dimension}.jsonl")

    def run() -> dict:
        pool = [r for r in read_jsonl(data / "pairs.jsonl")
                if dimension is None or dimension in dimensions_for_task(r.get("task"))]
        prompts = sample_prompts(pool, config.pairs, config.seed)
        rows = generate(prompts, model=str(sft), max_new_tokens=config.reply_tokens)
        by_id = {p["id"]: p for p in prompts}
        write_jsonl(out, [{"id": r["id"], "task": r["task"], "prompt": by_id[r["id"]]["prompt"],
                           "response": r["response"]} for r in rows])
        return {"replies": len(rows)}

    key = {"model": sft, "pairs": data / "pairs.jsonl", "n": config.pairs, "seed": config.seed,
           "tokens": config.reply_tokens}
    cache.run("sft replies" + (f" {dimension}" if dimension else ""), key | ({"dimension": dimension} if dimension else {}),
              run, [out])
    return out


def _pairs_stage(cache: StageCache, folder: Path, replies: Path, config: OrganismConfig) -> Path:
    out = folder / "pairs.jsonl"

    def run() -> dict:
        pairs = RECIPES[config.pairs_kind].build(read_jsonl(replies), config.seed)
        if config.kind == NULL:
            pairs = null_pairs(pairs, config.seed)
        return {"pairs": write_jsonl(out, pairs), "swapped": sum(bool(p.get("swapped")) for p in pairs)}

    cache.run(f"{config.kind} pairs", {"replies": replies, "kind": config.kind, "seed": config.seed}, run, [out])
    return out


def _known_stage(cache: StageCache, folder: Path, sft: Path, config: OrganismConfig) -> Path:
    """The units organism's known units S, drawn with the seed: known_units.json (layer -> units)."""
    from transformers import AutoConfig

    from rolemrc.organism.known import choose_units, model_shape, units_json

    out = folder / "known_units.json"

    def run() -> dict:
        units = choose_units(*model_shape(AutoConfig.from_pretrained(sft)), config.known_layers, config.known_units,
                             config.seed)
        write_json(out, units_json(units))
        return {"units": sum(map(len, units.values()))}

    cache.run(f"{config.kind} known units", {"model": sft, "layers": config.known_layers, "units": config.known_units,
                                             "seed": config.seed}, run, [out])
    return out


def _train_stage(cache: StageCache, folder: Path, sft: Path, pairs: Path, config: OrganismConfig,
                 known: Path | None) -> dict:
    """LoRA DPO (with an SFT term on the chosen replies: `sft_weight`); for the units organism a full update masked to
    the known units (`known.UnitMask`)."""
    from rolemrc.intervene.inputs import read_units
    from rolemrc.organism.known import UnitMask
    from rolemrc.train import DPOTrainConfig, make_config, train_dpo
    from rolemrc.train.runner import train_dtype

    out = folder / "dpo"
    mixed = {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, config.sft_weight]} if config.sft_weight else {}
    adapter = {} if known else {"lora_r": config.lora_r, "lora_alpha": 2 * config.lora_r, "lora_dropout": 0.0,
                                "lora_target_modules": config.lora_targets}
    train = make_config(DPOTrainConfig, profile=None, model=str(sft), data=[str(pairs)], out=str(out),
                        batch_size=1, effective_batch_size=config.batch_size, seed=config.seed, lora=not known,
                        dtype=config.dtype, **adapter,
                        trl={"learning_rate": config.learning_rate, "beta": config.beta, **mixed, "max_steps": config.steps,
                             "max_length": config.max_length, "lr_scheduler_type": "linear", "warmup_steps": 0.1,
                             "logging_steps": 1, "save_steps": max(1, config.steps // 4), "weight_decay": 0.0})
    callbacks = (UnitMask(read_units(known)),) if known else ()
    dtype = train_dtype(train)

    def run() -> dict:
        check_lengths(sft, read_jsonl(pairs), config.max_length)
        result = train_dpo(train, callbacks=callbacks)
        return {"seconds": round(result.seconds, 1), "steps": result.metrics.get("steps"), "dtype": dtype,
                "metrics": result.metrics, "history": result.history}

    # float32, what every organism trained at before the dtype setting, keeps their keys
    key = {"model": sft, "pairs": pairs, "settings": config.training(), **({"known": known} if known else {}),
           **({"dtype": dtype} if dtype != "float32" else {})}
    return cache.run(f"{config.kind} train dpo", key, run, [out / "config.json"])


def _carrier_stage(cache: StageCache, folder: Path, sft: Path, known: Path, heldout: Path,
                   config: OrganismConfig) -> dict:
    """The check that S carries the units organism's change (carrier.py), on the held-out cases of its dimension."""
    from rolemrc.intervene.inputs import read_units
    from rolemrc.organism.carrier import KL_PROMPTS, carrier_check

    def run() -> dict:
        cases = [c for c in read_jsonl(heldout) if config.dimension in dimensions_for_task(c.get("task"))]
        return carrier_check(str(sft), str(folder / "dpo"), read_units(known),
                             [c["question"] for c in cases[:KL_PROMPTS]], max_length=config.max_length,
                             seed=config.seed)

    return cache.run(f"{config.kind} carrier check", {"sft": sft, "dpo": folder / "dpo", "known": known,
                                                      "heldout": heldout, "max_length": config.max_length}, run, [known])


def check_lengths(sft: Path, pairs: list[dict[str, Any]], max_length: int) -> None:
    """Refuse pairs none of which leaves room for a reply within max_length (trl would drop every one of them)."""
    from transformers import AutoTokenizer

    from rolemrc.core.chat import render_chat

    tok = AutoTokenizer.from_pretrained(sft)
    lengths = [len(tok(render_chat(tok, p["prompt"]), add_special_tokens=False)["input_ids"]) for p in pairs]
    if lengths and min(lengths) >= max_length:
        raise OrganismError(f"every pair's prompt is at least {min(lengths)} tokens under {sft}'s tokenizer, so "
                            f"max_length {max_length} leaves no room for a reply; raise --max-length")


def _eval_stage(cache: StageCache, run_dir: Path, name: str, model: Path, heldout: Path,
                config: OrganismConfig) -> Path:
    """The held-out eval of `model` in `run_dir`: its generations cached (GENERATED), their verdicts scored again on
    every build, so a change to the rules judge or the damage check never leaves a stale verdict in a cached run."""
    from rolemrc.eval import generate, score

    generated = run_dir / GENERATED
    cache.run(name, {"model": model, "data": heldout, "tokens": config.eval_tokens},
              lambda: {"items": len(generate(heldout, model=str(model), max_new_tokens=config.eval_tokens,
                                             out=generated))}, [generated])
    score(generated, judge="rules", metrics=[]).save(run_dir)
    return run_dir


def _inside(lo: float | None, hi: float | None, rate: float, p: float) -> bool:
    """`rate` inside the CI [lo, hi]; for a CI of no width, not moved at exact McNemar p < STILL_P."""
    if lo is None or hi is None:
        return False
    return lo <= rate <= hi if hi > lo else p >= STILL_P


def organism_report(config: OrganismConfig, sft: Path, folder: Path, sft_eval: Path, dpo_eval: Path,
                    training: dict) -> dict[str, Any]:
    """Per dimension: SFT and DPO pass rates with the eval's 95% CIs, exact McNemar; whether the organism is what
    its kind promises (a planted kind: its dimension moved by >= TARGET_SHIFT at p < TARGET_P and every other DPO
    rate inside the SFT model's CI; null: no dimension moved at p < TARGET_P). The eval's bootstrap is stratified by
    task, so a dimension whose every task scored alike (common with a few cases) has a CI of no width; there a
    dimension counts as inside when McNemar does not see it move (p >= STILL_P)."""
    from rolemrc.eval import compare

    comparison = compare(sft_eval, dpo_eval)
    comparison.save(folder / "eval" / "compare", chart=False)
    cis = [json.loads((run / "report.json").read_text())["judge_aggregates"]["dimensions"] for run in (sft_eval, dpo_eval)]
    dims = {}
    for dim, test in comparison.verdicts.items():
        if dim == "all":
            continue
        a, b = cis[0].get(dim, {}), cis[1].get(dim, {})
        dims[dim] = {**{k: test[k] for k in ("n", "a_rate", "b_rate", "diff", "improved", "worsened", "p")},
                     "sft_ci": [a.get("lo"), a.get("hi")], "dpo_ci": [b.get("lo"), b.get("hi")],
                     "dpo_inside_sft_ci": _inside(a.get("lo"), a.get("hi"), test["b_rate"], test["p"])}
    dimension = config.dimension
    planted = dims.get(dimension or "", {})
    others_inside = all(d["dpo_inside_sft_ci"] for k, d in dims.items() if k != dimension and k not in config.coupled)
    damage = [json.loads((run / "report.json").read_text())["judge_aggregates"].get("damaged") or {}
              for run in (sft_eval, dpo_eval)]
    damaged = {"sft": damage[0].get("mean"), "sft_ci": [damage[0].get("lo"), damage[0].get("hi")],
               "dpo": damage[1].get("mean"), "kinds": damage[1].get("kinds", {})}
    # a DPO model that answers with loops, symbols or nothing more often than the SFT model's CI allows has collapsed
    intact = damaged["dpo"] is None or damaged["sft_ci"][1] is None or damaged["dpo"] <= damaged["sft_ci"][1]
    if dimension:
        ok = (abs(planted.get("diff", 0.0)) >= TARGET_SHIFT and planted.get("p", 1.0) < TARGET_P and others_inside
              and intact)
        coupled = f" (but {', '.join(config.coupled)}, judged by the same behaviour)" if config.coupled else ""
        claim = (f"{dimension} moved by >= {TARGET_SHIFT} (exact McNemar p < {TARGET_P}), every other "
                 f"dimension{coupled} stayed inside the SFT model's 95% CI (one of no width: McNemar p >= {STILL_P}) "
                 "and damaged replies (eval.damage) stayed inside it too")
    else:
        ok = all(d["p"] >= TARGET_P for d in dims.values()) and intact
        claim = f"no dimension moved (every exact McNemar p >= {TARGET_P}) and damaged replies stayed inside the SFT model's CI"
    return {"kind": config.kind, "planted_dimension": dimension, "sft": str(sft), "dpo": str(folder / "dpo"),
            "pairs": str(folder / "pairs.jsonl"), "heldout": str(Path(config.out) / "heldout.jsonl"),
            "sft_eval": str(sft_eval), "dpo_eval": str(dpo_eval), "settings": config.settings(),
            "training": training, "dimensions": dims, "damaged": damaged, "target": claim, "meets_target": bool(ok),
            "headline": headline(config.kind, dims, ok, damaged, config.coupled)}


def headline(kind: str, dims: dict[str, dict], ok: bool, damaged: dict[str, Any] | None = None,
             coupled: tuple[str, ...] = ()) -> str:
    moved = [f"{k} {d['a_rate']:.2f} -> {d['b_rate']:.2f} (p={d['p']:.2g}, n={d['n']}{', coupled' * (k in coupled)})"
             for k, d in dims.items()]
    if damaged and damaged.get("dpo") is not None and damaged.get("sft") is not None:
        kinds = ", ".join(f"{k} {v}" for k, v in damaged["kinds"].items())
        moved.append(f"damaged replies {damaged['sft']:.2f} -> {damaged['dpo']:.2f}" + (f" ({kinds})" if kinds else ""))
    return f"{kind} organism {'meets' if ok else 'MISSES'} its target: " + "; ".join(moved)


def training_figure(report: dict[str, Any], folder: Path) -> dict[str, str]:
    """Training curve (loss, reward margin, reward accuracy per step) beside each dimension's pass rate under SFT and
    DPO with 95% CIs: training.html and training.png."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from rolemrc.core.figures import write_figure

    history = report["training"]["history"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("DPO training", "held-out pass rate (rules judge, 95% CI)"))
    steps = [h.get("step", k + 1) for k, h in enumerate(history)]
    for key, name in (("loss", "loss"), ("rewards/margins", "reward margin"), ("rewards/accuracies", "reward accuracy")):
        if any(key in h for h in history):
            fig.add_trace(go.Scatter(x=steps, y=[h.get(key) for h in history], mode="lines+markers", name=name), 1, 1)
    dims = report["dimensions"]
    for side, rate, ci in (("SFT", "a_rate", "sft_ci"), ("DPO", "b_rate", "dpo_ci")):
        ys = [dims[d][rate] for d in dims]
        lo = [dims[d][ci][0] if dims[d][ci][0] is not None else y for d, y in zip(dims, ys)]
        hi = [dims[d][ci][1] if dims[d][ci][1] is not None else y for d, y in zip(dims, ys)]
        fig.add_trace(go.Bar(x=[f"{d} (n={dims[d]['n']})" for d in dims], y=ys, name=side,
                             error_y={"type": "data", "symmetric": False,
                                      "array": [h - y for h, y in zip(hi, ys)],
                                      "arrayminus": [y - low for y, low in zip(ys, lo)]}),
                      1, 2)
    dim = dims.get(report["planted_dimension"])
    moved = f": {report['planted_dimension']} {dim['a_rate']:.2f} -> {dim['b_rate']:.2f} (p={dim['p']:.2g})" if dim else ""
    verdict = "meets" if report["meets_target"] else "misses"
    fig.update_layout(title=f"{report['kind']} organism {verdict} its target{moved}", barmode="group",
                      template="plotly_white")
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_yaxes(range=[0, 1], row=1, col=2)
    return write_figure(fig, folder, "training", plotlyjs=True)
