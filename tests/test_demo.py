"""`rolemrc demo` end to end at a micro scale: every artifact exists, a rerun reuses every stage, and a
changed setting reruns only the stages downstream of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rolemrc.cli import app

MICRO_PROFILE = """
base: {vocab_size: 400, hidden: 64, layers: 2, intermediate: 128, heads: 1, max_positions: 1024, block_size: 128,
       learning_rate: 3.0e-3, max_steps: 4, batch_size: 8, logging_steps: 1, save_steps: 100}
sft: {learning_rate: 5.0e-4, max_steps: 3, batch_size: 4, max_length: 1024, logging_steps: 1, save_steps: 100}
dpo: {learning_rate: 5.0e-5, max_steps: 2, batch_size: 2, max_length: 1024, logging_steps: 1, save_steps: 100}
"""
TRAIN_AND_PROBE = ("datagen", "train base", "train sft", "train dpo", "eval sft", "eval dpo",
                   "probe sft+dpo", "probe diff", "explorer")
DOWNSTREAM = ("restraint select", "restraint bake", "restraint check", "eval dpo-restrained", "eval compare", "serve")


def demo(out: Path, profile: Path, *extra: str) -> dict:
    result = CliRunner().invoke(app, ["demo", "--out", str(out), "--size", "tiny", "--profile", str(profile),
                                      "--max-new-tokens", "8", "--top-k", "16", *extra])
    assert result.exit_code == 0, result.output
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    profile = root / "micro.yaml"
    profile.write_text(MICRO_PROFILE)
    return root / "out", profile, demo(root / "out", profile)


def test_demo_writes_every_artifact_and_an_honest_summary(first_run):
    out, _, summary = first_run
    for name, path in summary["artifacts"].items():
        assert Path(path).exists(), f"{name}: {path} missing"
    assert (out / "explorer.html").is_file() and list((out / "diff").glob("*.png"))
    assert summary["largest_shift"]["dimension"] in summary["restraint_effect"]["verdicts"]
    assert summary["restraint"]["factor"] == pytest.approx(1 - 1e-6)
    assert summary["conclusion"].startswith("The restraint changed")
    for run in ("sft", "dpo", "dpo-restrained"):
        ci = summary["eval"][run]["judge_avg_weighted"]
        assert ci["lo"] <= ci["mean"] <= ci["hi"]
    served = summary["serve"]
    assert served["hook_equals_baked"] is True and len(served["replies"]) == 4
    assert set(summary["stage_seconds"]) == set(summary["stages_run"]) == {*TRAIN_AND_PROBE, *DOWNSTREAM}
    assert json.loads((out / "stages.json").read_text()).keys() == summary["stage_seconds"].keys()


def test_rerun_reuses_every_stage_and_a_new_factor_reruns_only_downstream(first_run):
    out, profile, _ = first_run
    again = demo(out, profile)
    assert again["stages_run"] == [] and set(again["stage_seconds"].values()) == {0.0}
    ablated = demo(out, profile, "--factor", "0")
    assert set(ablated["stages_run"]) == set(DOWNSTREAM)   # select, bake, check, eval after, compare, serve
    assert ablated["restraint"]["factor"] == 0
