"""`rolemrc bench retrieval` at a small scale: exact answers and a complete report."""

from __future__ import annotations

from rolemrc.bench.retrieval import run


def test_retrieval_bench_small_is_exact_and_complete():
    result = run(300, 6000, 64, query_block=128, key_block=1000, check=64, progress=False)
    assert result["exact"] is True and result["checked_queries"] == 64 and result["faiss_top_agreement"] == 1.0
    for name in ("one_pass", "single_search"):
        assert result[name]["seconds"] > 0 and result[name]["gflops"] > 0 and result[name]["fraction_of_matmul"] > 0
    assert result["numpy_matmul_gflops"] > 0
    assert result["one_pass_vs_single_search"] > 0 and isinstance(result["meets_target"], bool)
    assert (result["query_block"], result["key_block"], result["rounds"]) == (128, 1000, 5) and "ivf" not in result


def test_retrieval_bench_ivf_reports_recall():
    result = run(100, 4000, 32, kind="ivf", nlist=16, nprobe=16, progress=False)
    assert result["index"] == "ivf" and result["exact"] is True
    ivf = result["ivf"]
    assert ivf["nlist"] == 16 and ivf["nprobe"] == 16 and ivf["recall_queries"] == 100
    assert ivf["recall_at_1"] == {"top": 1.0, "bottom": 1.0}   # probing every list is exact
    assert ivf["build_seconds"] > 0 and ivf["search_seconds"] > 0
