"""`rolemrc bench probe|intervene|serve` at a tiny scale: the reports are complete and their checks hold.

The speed ratios are not asserted (they belong to the benchmark runs, not to tests); what is asserted
is what must hold at any scale: the counts agree with the RoleMRC-code baseline, hook and bake agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rolemrc.bench.cli import app
from rolemrc.bench.common import make_model_dir


def bench(*args: str) -> dict:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_probe_bench_report():
    out = bench("probe", "--prompts", "8", "--length", "12", "--batch-size", "4", "--repeats", "1", "--sizes", "demo")
    demo = out["demo"]
    assert demo["plain_forward_s"] > 0 and demo["collect_mlp.act_over_forward"] > 0
    assert demo["speedup_over_rolemrc_code"] > 0
    assert demo["counts_agreement_with_baseline"] >= 0.99
    assert out["memory"]["peak_ratio_4n_over_n"] > 0


def test_intervene_bench_report():
    out = bench("intervene", "--prompts", "8", "--length", "12", "--batch-size", "4", "--repeats", "1",
                "--sizes", "demo")
    demo = out["demo"]
    assert demo["restrained_units"] > 0 and demo["hook_over_original"] > 0 and demo["baked_over_original"] > 0
    assert demo["hook_vs_baked_max_abs_logit"] < 1e-4


def test_serve_bench_report():
    out = bench("serve", "--concurrency", "2", "--tokens", "4", "--waves", "1", "--repeats", "1")
    ratios = out["results"]["2"]
    assert set(ratios["tokens_per_s"]) == {"naive", "batched", "restrained", "baked"}
    assert all(v > 0 for v in ratios["tokens_per_s"].values())


def test_unknown_size_is_named(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark size 'huge'; known: demo, medium, large"):
        make_model_dir("huge", tmp_path)


def test_make_bench_runs_a_registered_command():
    makefile = (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    line = next(ln for ln in makefile.splitlines() if "rolemrc bench" in ln)
    args = line.split("rolemrc bench", 1)[1].split()
    result = CliRunner().invoke(app, [args[0], "--help"])
    assert result.exit_code == 0 and "--out" in result.stdout
