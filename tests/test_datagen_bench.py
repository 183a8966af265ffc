"""`rolemrc bench retrieval` at a small scale: exact answers and a complete report."""

from __future__ import annotations

from rolemrc.bench.retrieval import run


def test_retrieval_bench_small_is_exact_and_complete():
    result = run(300, 6000, 64, progress=False)
    assert result["exact"] is True and result["checked_queries"] == 64
    for name in ("top1", "bottom1"):
        assert result[name]["seconds"] > 0 and result[name]["fraction_of_matmul"] > 0
    assert result["numpy_matmul_gflops"] > 0 and isinstance(result["meets_target"], bool)


def test_retrieval_bench_ivf_runs():
    result = run(100, 4000, 32, kind="ivf", progress=False)
    assert result["index"] == "ivf" and "exact" not in result
