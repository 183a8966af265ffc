"""`rolemrc bench generate` at a tiny scale: the report is complete and every rate and ratio is a positive number;
the workloads are what the report says; sizes the run cannot measure are refused before any model loads.

The speed ratios themselves are not asserted (they belong to benchmark runs, not to tests)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from rolemrc.bench.cli import app
from rolemrc.bench.generate import VARIANTS, WORKLOADS, workload


def test_generate_bench_report():
    result = CliRunner().invoke(app, ["generate", "--size", "demo", "--concurrency", "2", "--tokens", "4",
                                      "--prompt-tokens", "8", "--waves", "1", "--repeats", "1", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["benchmark"] == "generate" and out["torch"] and out["transformers"] and out["torch_threads"] > 0
    demo = out["sizes"]["demo"]
    assert demo["model"]["layers"] == 4 and demo["restraints"]["count"] == 4
    assert set(demo["workloads"]) == set(WORKLOADS)
    for kind, by_c in demo["workloads"].items():
        assert set(by_c) == {"2"}, kind
        for c, row in by_c.items():
            assert set(row["tokens_per_s"]) == set(VARIANTS)
            assert set(row["ratios"]) == {"engine_vs_static", "engine_vs_generate_batch", "one_vs_unrestrained",
                                          "mix_of_kinds_vs_unrestrained"}
            numbers = [*row["tokens_per_s"].values(), *row["ratios"].values()]
            assert all(isinstance(v, float) and v > 0 for v in numbers), (kind, c, row)
            assert row["requests"] == int(c) and 0 < row["completion_tokens"] <= 4 * int(c)
    assert set(out["meets_targets"]) == set(out["targets"])
    assert all(v is None for v in out["meets_targets"].values())   # no target is measured at this scale


def test_workloads():
    fixed = workload("fixed", 6, 8, 16, vocab=300)
    assert [len(p) for p in fixed.prompts] == [8] * 6 and fixed.budgets == [16] * 6 and fixed.tokens == 96
    varied = workload("varied", 64, 8, 16, vocab=300)
    assert varied == workload("varied", 64, 8, 16, vocab=300)   # a fixed seed
    assert all(2 <= len(p) <= 16 for p in varied.prompts) and len({len(p) for p in varied.prompts}) > 4
    assert all(4 <= b <= 16 for b in varied.budgets) and len(set(varied.budgets)) > 4
    assert all(10 <= t < 300 for p in varied.prompts for t in p)


def test_sizes_the_run_cannot_measure_are_refused_before_loading():
    result = CliRunner().invoke(app, ["generate", "--size", "demo,llama-8b", "--device", "cpu"])
    assert result.exit_code == 2 and "error: --size llama-8b: GPU shapes" in result.output
    result = CliRunner().invoke(app, ["generate", "--size", "huge"])
    assert result.exit_code == 2 and "unknown size(s) ['huge']" in result.output
    for bad in ("1,x", "0", "8,,32"):
        result = CliRunner().invoke(app, ["generate", "--size", "demo", "--concurrency", bad])
        assert result.exit_code == 2 and f"error: --concurrency {bad}: give a comma list" in result.output
