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
    out = bench("probe", "--prompts", "8", "--length", "12", "--batch-size", "4", "--repeats", "1", "--sizes", "demo",
                "--min-seconds", "0")
    demo = out["demo"]
    assert demo["plain_forward_s"] > 0 and demo["collect_mlp.act_over_forward"]["median"] > 0
    assert demo["speedup_over_rolemrc_code"]["median"] > 0
    assert demo["counts_agreement_with_baseline"] >= 0.99
    assert out["memory"]["peak_ratio_4n_over_n"] > 0


def test_intervene_bench_report():
    out = bench("intervene", "--prompts", "8", "--length", "12", "--batch-size", "4", "--repeats", "2",
                "--sizes", "demo", "--min-seconds", "0.2")
    demo = out["demo"]
    ratios = [demo[f"{name}_over_original"] for name in ("hook", "hook_scale", "hook_patch", "hook_direction", "baked")]
    ratios.append(demo["unrestrained_over_mix_of_kinds"])
    assert demo["restrained_units"] > 0 and all(r["min"] <= r["median"] <= r["max"] and isinstance(r["noise"], bool)
                                                for r in ratios)
    assert all(calls >= 1 for calls in demo["calls_per_timed_run"].values())
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


def test_ratios_are_medians_over_interleaved_rounds_and_disagreeing_rounds_are_noise():
    import time

    from rolemrc.bench.common import Timings, interleaved

    t = Timings({"a": [1.0, 1.0, 1.0], "b": [2.0, 2.0, 2.6]}, {"a": 1, "b": 1})
    assert t.ratio("b", "a") == {"median": 2.0, "min": 2.0, "max": 2.6, "noise": True}
    assert t.ratio("a", "a")["noise"] is False and t["b"] == 2.0
    timed = interleaved({"quick": lambda: time.sleep(0.002), "slow": lambda: time.sleep(0.03)}, 2, min_seconds=0.06)
    assert timed.calls["quick"] >= 10 and timed.calls["slow"] <= 3   # each timed run lasts the minimum or more
    assert 0.002 <= timed["quick"] < 0.01 and len(timed.rounds["slow"]) == 2
