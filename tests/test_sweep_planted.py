"""The restraint sweep end to end on a model with a planted effect, and a sweep resumed after a real SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fixtures import ANSWER_CHAIN, answerable_records, save_planted_llama, write_diff_file, write_sweep_inputs
from fixtures import ANSWERABLE_UNITS as UNITS
from fixtures import PLANTED_WIDTH as WIDTH

from rolemrc.core.io import read_jsonl, write_jsonl
from rolemrc.sweep import SweepConfig, run_sweep
from rolemrc.sweep import plots as sweep_plots


@pytest.fixture(scope="module")
def planted(tmp_path_factory, tokenizer) -> Path:
    root = tmp_path_factory.mktemp("planted")
    save_planted_llama(root / "model", tokenizer)
    delta = torch.linspace(-0.1, 0.1, 2 * WIDTH).reshape(2, WIDTH)   # every unit moved a little, UNITS most
    delta[1, UNITS] = torch.tensor([0.9, -1.0, 0.8, 0.7])
    write_diff_file(root / "diff", delta, torch.full_like(delta, 0.01))
    write_jsonl(root / "test.jsonl", answerable_records(12))
    return root


def responses(out: Path, cell_id: str) -> list[str]:
    return [r["response"] for r in read_jsonl(out / "cells" / f"{cell_id}.jsonl")]


def test_a_planted_refusal_is_found_and_beats_its_controls(planted, tmp_path, monkeypatch):
    monkeypatch.setattr(sweep_plots, "write_sweep_figures", lambda summary, out: {})   # PNGs: ~10 s, tested elsewhere
    config = SweepConfig(model=str(planted / "model"), diff=str(planted / "diff"), data=str(planted / "test.jsonl"),
                         out=str(tmp_path), dimensions=["multi_turn"], method="frequency", factors=[0.0, 1.0],
                         top_k=[len(UNITS)],
                         controls=2, max_new_tokens=6, batch_size=16)
    summary = run_sweep(config, metrics=("rouge",), progress=False)
    plan = json.loads((tmp_path / "plan.json").read_text())["cells"]
    zeroed, kept = summary["cells"]
    assert [(c["factor"], c["units"]) for c in (zeroed, kept)] == [(0.0, 4), (1.0, 4)]
    assert plan[1]["restraint"]["units"] == {"1": sorted(UNITS)}

    base = responses(tmp_path, plan[0]["id"])
    assert all(r.startswith("cannot answer cannot answer") for r in base)   # the planted refusal
    assert all(r.startswith(" ".join(ANSWER_CHAIN)) for r in responses(tmp_path, zeroed["id"]))   # no loop
    controls = [c["id"] for c in plan if c["kind"] == "control"]
    assert len(controls) == 4 and all(responses(tmp_path, c) == base for c in controls)
    assert responses(tmp_path, kept["id"]) == base

    judge = zeroed["scores"]["judge:multi_turn"]
    assert summary["baseline"]["judge:multi_turn"] == 0 and judge["mean"] == 1 and judge["controls_mean"] == 0
    for family in ("vs_baseline", "vs_controls"):
        test = judge[family]
        assert test["diff"] == 1 and test["lo"] > 0 and test["p_holm"] < 0.05, (family, test)
    assert zeroed["weight_elements_changed"] == 4 and zeroed["max_logit_shift"] > 1   # one nonzero weight per column
    assert kept["weight_elements_changed"] == 0 and kept["max_logit_shift"] == 0
    assert all(e["vs_baseline"]["diff"] == 0 and e["vs_controls"]["diff"] == 0 and e["vs_baseline"]["p_holm"] == 1
               for e in kept["scores"].values())
    assert summary["headline"].startswith("1 of 2 cells beat both the baseline and their random-unit controls")
    # the refusal shared "answer" with the reference, so ROUGE drops: the headline names that cost
    assert "multi_turn top-4 x0 (multi_turn; cost: rouge1, rougeL, rougeLsum)." in summary["headline"]


@pytest.fixture(scope="module")
def peaked(tmp_path_factory, tokenizer) -> Path:
    """The peaked small Llama of test_intervene_sweep, a diff over its 2 x 96 mlp.act units, 16 test records (a pass
    of 4 cells is 8 batches of 8 rows: seconds to be killed in, polled every 50 ms)."""
    root = tmp_path_factory.mktemp("sweep-kill")
    write_sweep_inputs(root, tokenizer, 16)
    return root


def sweep_args(root: Path, out: Path) -> list[str]:
    """`rolemrc sweep run`'s arguments: 1 baseline + 4 factors x (1 + 2 controls) = 13 cells, so 4 passes (the CLI
    generates 4 cells per pass)."""
    return ["sweep", "run", "--model", str(root / "model"), "--diff", str(root / "diff"), "--data",
            str(root / "test.jsonl"), "--out", str(out), "--dimension", "multi_turn", "--method", "frequency",
            "--factors", "0.75,0.5,0.25,0", "--top-k", "8", "--controls", "2", "--metrics", "rouge",
            "--max-new-tokens", "24", "--batch-size", "8"]


def sweep_cli(root: Path, out: Path) -> subprocess.Popen:
    """The sweep in its own process (the one a SIGKILL ends), on one thread; stderr to OUT.log."""
    args = [sys.executable, "-m", "rolemrc.cli", *sweep_args(root, out)]
    with out.with_suffix(".log").open("a") as log:
        return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "OMP_NUM_THREADS": "1"})


def sweep_here(root: Path, out: Path) -> None:
    """The same sweep in this process, through the CLI (its PNG figures skipped: outputs() leaves sweep.json's
    figures out; the peaked model's greedy margins leave no reply to the thread count)."""
    from typer.testing import CliRunner

    from rolemrc.cli import app

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sweep_plots, "write_sweep_figures", lambda summary, out: {})
        result = CliRunner().invoke(app, sweep_args(root, out))
    assert result.exit_code == 0, result.output[-3000:]


def first_pass(out: Path) -> list[Path]:
    """The cell files of the first pass: the first 4 cells of OUT/plan.json."""
    return [out / "cells" / f"{c['id']}.jsonl" for c in json.loads((out / "plan.json").read_text())["cells"][:4]]


def first_pass_saved(out: Path) -> bool:
    return (out / "plan.json").is_file() and all(p.is_file() for p in first_pass(out))


def outputs(out: Path) -> tuple[dict, dict[str, list[str]]]:
    """sweep.json less what depends on the folder (config.out, figure paths), and every cell's responses."""
    summary = json.loads((out / "sweep.json").read_text())
    summary["config"].pop("out")
    summary.pop("figures")
    return summary, {p.stem: [r["response"] for r in read_jsonl(p)] for p in (out / "cells").glob("*.jsonl")}


def test_a_sweep_killed_mid_generation_resumes_to_identical_results(peaked, tmp_path):
    """SIGKILL as soon as the first pass is saved (so during the second pass's generation), rerun in the same
    folder, and compare with an uninterrupted sweep (both runs in this process: the process killed is the first)."""
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    proc = sweep_cli(peaked, killed)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not first_pass_saved(killed):
        time.sleep(0.05)
    assert proc.poll() is None, "the sweep ended before it could be killed: " + killed.with_suffix(".log").read_text()[-3000:]
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    kept = sorted((killed / "cells").glob("*.jsonl"))
    assert kept == sorted(first_pass(killed)), "killed outside the second pass"
    assert not list(killed.rglob("*.tmp")) and not (killed / "sweep.json").exists()
    stamps = [p.stat().st_mtime_ns for p in kept]

    sweep_here(peaked, killed)
    sweep_here(peaked, whole)
    assert [p.stat().st_mtime_ns for p in kept] == stamps   # the kept cells were not generated again
    assert outputs(killed) == outputs(whole)
    assert len(outputs(whole)[1]) == 13
