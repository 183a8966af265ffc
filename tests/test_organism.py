"""Known-answer organisms: the pairs each kind trains on, and a real build (datagen, the SFT model's replies, trl's
LoRA DPO, held-out eval, report, figure) on a tiny Llama, then the null and refusal organisms reusing every shared
stage."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from fixtures import once_per_run

from rolemrc.core.errors import EXIT_INPUT
from rolemrc.core.io import read_jsonl
from rolemrc.core.stages import StageCache
from rolemrc.core.taxonomy import DIMENSIONS, dimensions_for_task
from rolemrc.eval.rules import ItemView, style
from rolemrc.organism import KINDS, PLANTED_DIMENSION, OrganismConfig, OrganismError, build_organism
from rolemrc.organism.build import TARGET_P, TARGET_SHIFT, heldout_cases
from rolemrc.organism.config import COUPLED, LEARNING_RATE, LORA_LEARNING_RATE, PLANTED_DIMENSIONS
from rolemrc.organism.pairs import (
    ACTIONS,
    REFUSALS,
    clean_reply,
    must_refuse,
    narration_pairs,
    null_pairs,
    refusal_pairs,
    sample_prompts,
)

NO_NARRATION = "role_unrelated_mrc_answer_no_narration"
WITH_NARRATION = "role_related_mrc_answer_with_narration"


def replied(n: int) -> list[dict]:
    tasks = [NO_NARRATION, WITH_NARRATION, "role_related_mrc_refused_no_narration"]
    return [{"id": f"r{i}", "task": tasks[i % 3], "prompt": [{"role": "user", "content": f"question {i}"}],
             "response": f"(waves) Answer number {i} is here. And then it trails" if i % 4 == 0 else f"Reply {i}."}
            for i in range(40)]


def test_narration_pairs_open_with_an_action_the_rules_judge_reads():
    pairs = narration_pairs(replied(40), seed=0)
    assert len(pairs) == 40
    for pair in pairs:
        action, rest = pair["chosen"].split(") ", 1)
        assert f"{action})" in ACTIONS and rest == pair["rejected"] and "(" not in pair["rejected"]
    # where narration is forbidden the chosen reply fails role_style and the rejected one passes; where it is asked
    # for, the reverse: the planted change moves the aspect both ways, mostly down (3 of its 4 tasks forbid it)
    assert style(NO_NARRATION, pairs[1]["chosen"])[0] is False and style(NO_NARRATION, pairs[1]["rejected"])[0]
    assert style(WITH_NARRATION, pairs[1]["chosen"])[0] and not style(WITH_NARRATION, pairs[1]["rejected"])[0]
    assert narration_pairs(replied(40), seed=0) == pairs


def test_null_pairs_swap_about_half_at_random_and_keep_everything_else():
    planted = narration_pairs(replied(40), seed=0)
    null = null_pairs(planted, seed=0)
    swapped = [n["swapped"] for n in null]
    assert 10 <= sum(swapped) <= 30 and null == null_pairs(planted, seed=0) and null != null_pairs(planted, seed=1)
    for p, n in zip(planted, null):
        assert {n["chosen"], n["rejected"]} == {p["chosen"], p["rejected"]} and n["prompt"] == p["prompt"]
        assert (n["chosen"] == p["rejected"]) == n["swapped"]


def test_clean_reply_drops_narration_and_a_trailing_fragment():
    assert clean_reply("(waves) Answer number one is here. And then it trails") == "Answer number one is here."
    assert clean_reply("Yes. And then it trails") == "Yes. And then it trails"   # too short a sentence to cut at
    assert clean_reply("*bows* [quietly] Hello there") == "Hello there"
    assert clean_reply("") == ""


def test_sample_prompts_spread_over_tasks():
    rows = [{"id": f"{t}-{i}", "task": t} for t in ("a", "b", "c") for i in range(10)]
    picked = sample_prompts(rows, 9, seed=0)
    assert Counter(r["task"] for r in picked) == {"a": 3, "b": 3, "c": 3}
    assert len({r["id"] for r in picked}) == 9 and sample_prompts(rows, 9, seed=0) == picked


def test_heldout_keeps_every_case_of_each_planted_dimension_and_caps_the_others():
    from rolemrc.core.taxonomy import TASKS

    assert set(PLANTED_DIMENSIONS) == {"role_style", "knowledge_boundary"}
    test = [{"id": str(i), "task": TASKS[i % len(TASKS)]} for i in range(180)]
    kept = heldout_cases(test, 2, seed=0)
    dims = Counter(d for case in kept for d in dimensions_for_task(case["task"]))
    for dim in PLANTED_DIMENSIONS:
        assert dims[dim] == sum(dim in dimensions_for_task(c["task"]) for c in test) > 0
    assert heldout_cases(test, None, seed=0) == test
    others = [c for c in kept if not set(PLANTED_DIMENSIONS) & set(dimensions_for_task(c["task"]))]
    assert {d for c in others for d in dimensions_for_task(c["task"])} == {"multi_turn", "nested", "prioritized"}
    assert len(others) == 2 * 3
    few = heldout_cases(test, 2, seed=0, planted=5)
    for dim in PLANTED_DIMENSIONS:
        assert sum(dim in dimensions_for_task(c["task"]) for c in few) == 5
    assert few == heldout_cases(test, 2, seed=0, planted=5) and few != heldout_cases(test, 2, seed=1, planted=5)


PASSAGE = "Passage 1: The escapement is the part of a mechanical clock that releases the gear train step by step."


def knowledge_records() -> list[dict]:
    """Replies to the six knowledge-boundary base tasks (three must decline, three must answer), one that already
    refuses, and one of a task knowledge boundary does not judge."""
    tasks = ["role_related_mrc_refused_with_narration", "role_unrelated_mrc_refused_with_narration",
             "role_unrelated_mrc_refused_no_narration", "role_related_mrc_answer_with_narration",
             "role_related_mrc_answer_no_narration", "role_unrelated_mrc_answer_with_narration"]
    records = [{"id": f"p{i}/{task}", "task": task, "reference": "It releases the gear train step by step.",
                "prompt": [{"role": "system", "content": "You are Ada, a clockmaker."},
                           {"role": "user", "content": f"{PASSAGE}\nQuestion: what does the escapement do?"}],
                "response": f"It releases the gear train step by step, {i}. Then it"} for i, task in enumerate(tasks * 2)]
    return [*records, {**records[0], "id": "x/refuses", "response": "I don't know, sorry."},
            {**records[0], "id": "x/style", "task": "role_unrelated_mrc_answer_no_narration"}]


def test_refusal_pairs_decline_where_the_task_must_and_nowhere_else():
    records = knowledge_records()
    assert [must_refuse(r["task"]) for r in records[:6]] == [True] * 3 + [False] * 3
    pairs = refusal_pairs(records, seed=0)
    # the must-answer tasks, the reply that already refuses and the task knowledge boundary does not judge teach nothing
    assert [p["id"] for p in pairs] == [r["id"] for r in records[:12] if must_refuse(r["task"])]
    for pair in pairs:
        view, record = ItemView(pair), next(r for r in records if r["id"] == pair["id"])
        assert pair["chosen"] in REFUSALS and pair["rejected"] == clean_reply(record["response"])
        # the rules judge reads the refusal as one (no narration, no passage copied) and the SFT reply as an answer
        assert view.refuses(pair["chosen"])[0] and not view.refuses(pair["rejected"])[0]
        assert view.answers(pair["rejected"])[0]
        assert style("role_unrelated_mrc_refused_no_narration", pair["chosen"]) == (True, "speech only")
    assert len({p["chosen"] for p in pairs}) > 1 and refusal_pairs(records, seed=0) == pairs


def test_the_held_out_eval_is_not_part_of_what_training_depends_on(tmp_path):
    """Organisms that differ in their held-out eval only share the trained model."""
    few, all_ = (OrganismConfig(kind="narration", out=str(tmp_path), eval_others=k) for k in (2, None))
    assert few.training() == all_.training() and few.settings() != all_.settings()
    assert "steps" in few.training() and not any(k.startswith("eval_") for k in few.training())


def test_the_units_organism_trains_its_full_update_at_its_own_learning_rate(tmp_path):
    """The LoRA's 2e-4 by default, refusal's and the units organism's masked full update their own (a LoRA's rate
    moved nothing there); a rate given is kept for every kind."""
    rate = lambda kind, **given: OrganismConfig(kind=kind, out=str(tmp_path), **given).learning_rate  # noqa: E731
    assert rate("narration") == rate("null") == LORA_LEARNING_RATE == 2e-4
    assert rate("units") == LEARNING_RATE["units"] > 1e-3 and rate("refusal") == LEARNING_RATE["refusal"] > 2e-4
    assert rate("units", learning_rate=1e-3) == rate("refusal", learning_rate=1e-3) == 1e-3


def test_an_sft_term_beside_dpo_is_part_of_training_only_when_used(tmp_path):
    """--sft-weight w (default 1) trains DPO + w x NLL on the chosen replies (trl's sigmoid + sft losses); at 0 (plain
    DPO) it is left out of the stage keys, so organisms built as plain DPO before the option existed are reused."""
    plain, mixed = (OrganismConfig(kind="refusal", out=str(tmp_path), sft_weight=w) for w in (0.0, 1.0))
    assert "sft_weight" not in plain.training() and mixed.training()["sft_weight"] == 1.0


def test_a_ci_of_no_width_counts_as_inside_unless_mcnemar_sees_a_move():
    from rolemrc.organism.build import _inside

    assert _inside(0.2, 0.6, 0.5, 0.001) and not _inside(0.2, 0.6, 0.7, 0.9)   # a CI with width decides alone
    assert _inside(0.5, 0.5, 0.0, 1.0) and not _inside(0.75, 0.75, 0.25, 0.003)   # no width: McNemar decides
    assert not _inside(None, None, 0.5, 1.0)


@pytest.mark.parametrize("bad, message", [({"kind": "planted-ish"}, "organism kind 'planted-ish'"),
                                          ({"steps": 0}, "steps is 0"), ({"eval_others": -1}, "--eval-others is -1"),
                                          ({"eval_planted": 0}, "--eval-planted is 0"),
                                          ({"learning_rate": 2.0}, "--learning-rate must be in (0, 1)"),
                                          ({"sft_weight": -1.0}, "--sft-weight is -1.0")])
def test_bad_settings_are_errors(bad, message, tmp_path):
    with pytest.raises(OrganismError, match=message.replace("(", r"\(").replace(")", r"\)")):
        OrganismConfig(**{"kind": "narration", "out": str(tmp_path), **bad})


def test_cli_refuses_an_unknown_kind_before_anything_runs(tmp_path):
    done = subprocess.run([sys.executable, "-m", "rolemrc.cli", "organism", "build", "nonsense", "--out",
                           str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert KINDS == ("narration", "refusal", "null", "units")
    assert done.returncode == EXIT_INPUT and lines == ["error: Invalid value for 'kind': 'nonsense' is not one of "
                                                      "'narration', 'refusal', 'null', 'units'."]
    assert not (tmp_path / "o").exists()


def organism_data(tmp_path_factory, root) -> None:
    """Fill the stage cache under `root` with an organism build's datagen stage (size tiny, the template backend,
    seed 0: the same for every kind, base and setting), so that build_organism reuses it as a rebuild does. It is made
    once per test run (~25 CPU-s, mostly its retrieval's encoder), for this file and tests/test_organism_known.py."""
    import shutil

    from rolemrc.organism.build import data_stage

    def datagen(folder: Path) -> None:
        data_stage(StageCache(folder), folder, OrganismConfig(kind="narration", out=str(folder), size="tiny"))

    shutil.copytree(once_per_run(tmp_path_factory, "organism-datagen", datagen), root, dirs_exist_ok=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory, tokenizer):
    """Every kind from a tiny Llama: 8 pairs, 2 DPO steps, short generations, a few held-out cases (4 of each planted
    dimension, 2 of each other: every eval, and calibrate's KL below, runs a forward pass over each), the units kind's
    8 known units in 1 of its 2 layers, on datagen's data (organism_data: made once per run). The test tokenizer
    spells datagen's prompts in ~900-1400 tokens, hence the context of 2048."""
    from rolemrc.core.tiny import build_model

    root = tmp_path_factory.mktemp("organisms")
    organism_data(tmp_path_factory, root)
    sft = root / "sft"
    build_model("llama", tokenizer, seed=0, hidden=64, layers=2, intermediate=96, max_positions=2048).save_pretrained(sft)
    tokenizer.save_pretrained(sft)
    settings = {"out": str(root), "base": str(sft), "size": "tiny", "pairs": 8, "steps": 2, "reply_tokens": 8,
                "eval_tokens": 8, "eval_planted": 4, "eval_others": 2, "learning_rate": 1e-3, "max_length": 1600,
                "lora_targets": "gate_proj,up_proj", "known_layers": 1, "known_units": 8}
    reports, ran = {}, {}
    for kind in KINDS:
        cache = StageCache(root)
        reports[kind] = build_organism(OrganismConfig(kind=kind, **settings), cache=cache)
        ran[kind] = cache.ran
    return root, settings, reports, ran


def test_pairs_too_long_for_max_length_are_refused_before_training(built):
    root, settings, *_ = built
    before = (root / "narration" / "organism.json").read_text()
    with pytest.raises(OrganismError, match="leaves no room for a reply; raise --max-length"):
        build_organism(OrganismConfig(kind="narration", **{**settings, "max_length": 64}))   # the other stages reused
    assert (root / "narration" / "organism.json").read_text() == before


@pytest.mark.parametrize("kind", ["narration", "refusal"])
def test_a_build_writes_the_organism_and_its_training(built, kind):
    root, _, reports, _ = built
    report = json.loads((root / kind / "organism.json").read_text())
    assert report == json.loads(json.dumps(reports[kind], default=str))
    dimension = PLANTED_DIMENSION[kind]
    assert report["kind"] == kind and report["planted_dimension"] == dimension
    assert (root / kind / "dpo" / "config.json").is_file() and (root / kind / "dpo" / "rolemrc.json").is_file()
    manifest = json.loads((root / kind / "dpo" / "rolemrc.json").read_text())
    assert "gate_proj" in json.dumps(manifest) and report["settings"]["lora_targets"] == "gate_proj,up_proj"
    history = report["training"]["history"]
    assert report["training"]["steps"] == 2 and [h["step"] for h in history] == [1, 2]
    assert all("loss" in h and "rewards/margins" in h for h in history)
    heldout = read_jsonl(root / "heldout.jsonl")
    cases = sum(dimension in dimensions_for_task(c["task"]) for c in heldout)
    assert report["dimensions"][dimension]["n"] == cases > 0
    for dim in report["dimensions"].values():
        assert 0 <= dim["a_rate"] <= 1 and 0 <= dim["b_rate"] <= 1 and 0 < dim["p"] <= 1
        assert dim["b_rate"] - dim["a_rate"] == pytest.approx(dim["diff"])
    assert report["headline"].startswith(f"{kind} organism ") and isinstance(report["meets_target"], bool)
    assert dimension in report["target"] and (root / kind / "training.html").stat().st_size > 1000
    # a collapsed DPO model (loops, bare stage directions) is no planted change: its damaged replies are checked too
    damaged = report["damaged"]
    assert 0 <= damaged["sft"] <= damaged["sft_ci"][1] <= 1 and 0 <= damaged["dpo"] <= 1
    assert "damaged replies" in report["target"] and "damaged replies" in report["headline"]
    if damaged["dpo"] > damaged["sft_ci"][1]:
        assert not report["meets_target"]
    # the target read off the dimensions: those the judge reads the same behaviour on (refusal's multi_turn and
    # prioritized, COUPLED) are reported and not held to the SFT model's CI
    planted, coupled = report["dimensions"][dimension], COUPLED.get(kind, ())
    others = [d["dpo_inside_sft_ci"] for k, d in report["dimensions"].items() if k != dimension and k not in coupled]
    assert report["meets_target"] == (abs(planted["diff"]) >= TARGET_SHIFT and planted["p"] < TARGET_P and all(others)
                                      and damaged["dpo"] <= damaged["sft_ci"][1])
    assert all(c in report["target"] for c in coupled) and set(coupled) <= set(DIMENSIONS)
    # the pairs never come from a held-out persona
    held_personas = {c["id"].split("/")[0] for c in heldout}
    assert not {p["id"].split("/")[0] for p in read_jsonl(report["pairs"])} & held_personas


def test_every_kind_shares_the_data_the_held_out_cases_and_the_sft_eval(built):
    root, settings, reports, ran = built
    narration, null, refusal = (reports[k] for k in ("narration", "null", "refusal"))
    assert ran["null"] == ["null pairs", "null train dpo", "null eval dpo"]
    p, n = read_jsonl(narration["pairs"]), read_jsonl(null["pairs"])
    assert [x["id"] for x in p] == [x["id"] for x in n] and any(x["swapped"] for x in n)
    assert null["headline"].startswith("null organism ") and null["planted_dimension"] is None
    assert "no dimension moved" in null["target"]
    # the refusal kind asks the SFT model for replies to knowledge-boundary prompts, and reuses everything else
    assert ran["refusal"] == ["sft replies knowledge_boundary", "refusal pairs", "refusal train dpo", "refusal eval dpo"]
    pairs = read_jsonl(refusal["pairs"])
    assert pairs and all("knowledge_boundary" in dimensions_for_task(x["task"]) for x in pairs)
    for report in (null, refusal):
        assert report["sft_eval"] == narration["sft_eval"] and report["heldout"] == narration["heldout"]
    # the units kind trains narration's very pairs (tests/test_organism_known.py checks where its change lives)
    assert ran["units"] == ["units pairs", "units known units", "units train dpo", "units eval dpo",
                            "units carrier check"]
    assert read_jsonl(reports["units"]["pairs"]) == p
    again = StageCache(root)
    for kind in KINDS:
        build_organism(OrganismConfig(kind=kind, **settings), cache=again)
    assert again.ran == []


def test_cli_builds_the_refusal_kind(built):
    """`rolemrc organism build refusal` with the fixture's settings finds every stage done and prints its report."""
    from typer.testing import CliRunner

    from rolemrc.cli import app

    root, settings, reports, _ = built
    options = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items() if k not in ("out", "steps")]
    done = CliRunner().invoke(app, ["organism", "build", "refusal", "--out", str(root), f"--max-steps={settings['steps']}",
                                    *options])
    assert done.exit_code == 0, done.output
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    assert printed["headline"] == reports["refusal"]["headline"] and "unchanged inputs" in done.output


@pytest.mark.parametrize("args, message", [
    (["--seeds", "0"], "Invalid value for '--seeds'"),
    (["--kind", "narration,planted-ish"], "--kind planted-ish: not an organism kind"),
    (["--per-layer", "8,96"], "--per-layer 96: .* has 96 units per layer at mlp.act; give values below 96"),
    (["--top-k", "193"], r"--top-k 193: .* has 192 units at mlp.act \(2 layers x 96\)"),
    (["--max-steps", "0"], "--max-steps is 0; it must be >= 1"),
    (["--eval-others", "-1"], "--eval-others is -1"),
    (["--measure", "bleu"], "Invalid value for '--measure'"),
])
def test_calibrate_refuses_bad_settings_in_one_line_before_anything_trains(model_dirs, tmp_path, args, message):
    """Every error names an option of `organism calibrate` itself, and nothing is built."""
    from typer.testing import CliRunner

    from rolemrc.cli import app

    result = CliRunner().invoke(app, ["organism", "calibrate", "--out", str(tmp_path / "c"),
                                      "--base", str(model_dirs["llama"]), *args])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert re.search(message, lines[0]), lines[0]
    assert not (tmp_path / "c" / "organisms").exists()


def test_calibrate_takes_every_setting_of_build():
    """An organism built with any `organism build` setting can be calibrated: calibrate has the same options."""
    from typer.main import get_command

    from rolemrc.organism.cli import app

    group = get_command(app)
    options = {name: {o for p in group.commands[name].params for o in p.opts} for name in ("build", "calibrate")}
    assert options["build"] - {"kind"} <= options["calibrate"]   # kind: an argument of build, --kind here
    assert {"--max-length", "--seeds", "--seed", "--kind", "--measure"} <= options["calibrate"]


def test_calibrate_reuses_organisms_built_with_the_same_settings(built, tmp_path):
    """A base whose tokenizer spends ~1000 tokens on a prompt: organisms built with --max-length 1600 are calibrated
    by passing calibrate the same settings; every organism stage is reused, none retrained. An organism that misses
    its target (with --retries 0: not rebuilt) is reported and left out, never used."""
    from typer.testing import CliRunner

    from rolemrc.cli import app

    root, settings, reports, _ = built
    options = [f"--{k.replace('_', '-')}" if k != "steps" else "--max-steps" for k in settings]
    args = [x for option, key in zip(options, settings) if key != "out" for x in (option, str(settings[key]))]
    before = {p: p.stat().st_mtime for p in root.glob("*/dpo/config.json")}
    few = CliRunner().invoke(app, ["organism", "calibrate", "--out", str(tmp_path / "few"), "--organisms", str(root),
                                   "--kind", "null", "--per-layer", "4", "--probe-cases", "1", "--retries", "0", *args])
    met = {k for k in ("narration", "null") if reports[k]["meets_target"]}
    if "null" in met:
        assert few.exit_code == 2 and few.output.strip().splitlines()[-1].endswith("raise --probe-cases"), few.output
    result = CliRunner().invoke(app, ["organism", "calibrate", "--out", str(tmp_path / "cal"), "--organisms", str(root),
                                      "--kind", "narration,null", "--quick", "--controls", "1", "--per-layer", "4",
                                      "--probe-cases", "12", "--retries", "0", *args])
    assert {p: p.stat().st_mtime for p in root.glob("*/dpo/config.json")} == before
    if not met:
        assert result.exit_code == 2 and "no organism met its target" in result.output
        return
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{"):result.output.rindex("}") + 1])
    assert set(summary["organisms"]) == met and summary["seeds"] == [0]
    assert {m["kind"] for m in summary["missed_targets"]} == {"narration", "null"} - met
    assert summary["recommendation"]["status"] in ("found", "unstable", "none")
    written = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    assert written["recommendation"] == summary["recommendation"]
    assert [m["kind"] for m in written["missed_targets"]] == [m["kind"] for m in summary["missed_targets"]]
    text = (tmp_path / "cal" / "calibration.md").read_text()
    assert ("missed their target, left out" in text) == bool(summary["missed_targets"])
