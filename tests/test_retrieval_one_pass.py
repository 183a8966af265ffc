"""The exact one-pass retrieval: numpy argmax/argmin to the index (ties, block edges), faiss agreement, errors."""

from __future__ import annotations

import numpy as np
import pytest

from rolemrc.datagen.config import DatagenError
from rolemrc.datagen.retrieval import build_index, extremes, one_pass, search_extremes


def _ints(rng: np.random.Generator, n: int, dim: int = 6) -> np.ndarray:
    """Small-integer vectors: every score is exact in float32 whatever the summation order, so ties are real."""
    return rng.integers(-2, 3, (n, dim)).astype(np.float32)


def _unit(rng: np.random.Generator, n: int, dim: int = 32) -> np.ndarray:
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _assert_numpy(ex, queries: np.ndarray, keys: np.ndarray) -> None:
    scores = queries @ keys.T
    np.testing.assert_array_equal(ex.top, scores.argmax(1))
    np.testing.assert_array_equal(ex.bottom, scores.argmin(1))
    np.testing.assert_array_equal(ex.top_score, scores.max(1))
    np.testing.assert_array_equal(ex.bottom_score, scores.min(1))


@pytest.mark.parametrize("queries,keys,query_block,key_block", [
    (37, 101, 8, 16),     # neither P nor T a multiple of its block
    (64, 128, 16, 32),    # both exact multiples
    (5, 10, 8, 16),       # P and T smaller than one block
    (9, 17, 1, 1),        # one query x one key at a time
    (40, 300, 64, 300),   # one key block holding every key
])
def test_one_pass_equals_numpy_with_ties(queries, keys, query_block, key_block):
    rng = np.random.default_rng(queries * 1000 + keys)
    q, k = _ints(rng, queries), _ints(rng, keys)   # 5^6 patterns over few keys: many tied scores
    _assert_numpy(one_pass(q, k, query_block=query_block, key_block=key_block), q, k)


def test_ties_across_key_blocks_go_to_the_lowest_index():
    rng = np.random.default_rng(3)
    q, k = _ints(rng, 20), _ints(rng, 64)
    k[[5, 21, 37, 63]] = 50.0                      # the same best key in every block of 16, with and after block edges
    k[[6, 16, 47]] = -50.0                         # the same worst key: at a block start, in a later block
    ex = one_pass(q, k, query_block=7, key_block=16)
    _assert_numpy(ex, q, k)
    positive = q.sum(1) > 0
    assert set(ex.top[positive]) <= {5} and set(ex.bottom[positive]) <= {6}


def test_one_pass_on_unit_vectors_matches_numpy_and_faiss():
    rng = np.random.default_rng(4)
    q, k = _unit(rng, 70), _unit(rng, 3000)
    ex = one_pass(q, k, query_block=32, key_block=512)
    scores = q @ k.T
    np.testing.assert_array_equal(ex.top, scores.argmax(1))
    np.testing.assert_array_equal(ex.bottom, scores.argmin(1))
    index = build_index(32, "flat")
    index.add(k)
    ref = search_extremes(index, q)
    np.testing.assert_array_equal(ex.top, ref.top)
    np.testing.assert_array_equal(ex.bottom, ref.bottom)
    np.testing.assert_allclose(ex.top_score, ref.top_score, atol=1e-5)
    np.testing.assert_allclose(ex.bottom_score, ref.bottom_score, atol=1e-5)


def test_flat_extremes_is_the_one_pass_at_default_blocks():
    rng = np.random.default_rng(5)
    q, k = _ints(rng, 1100, 8), _ints(rng, 17_000, 8)   # past one default query block and one key block
    _assert_numpy(extremes(q, k, "flat"), q, k)


def test_errors_and_empty_queries():
    k = _unit(np.random.default_rng(6), 10)
    with pytest.raises(DatagenError, match="no keys"):
        extremes(k[:3], k[:0], "flat")
    with pytest.raises(DatagenError, match="no keys"):
        extremes(k[:3], k[:0], "ivf")
    with pytest.raises(DatagenError, match="dimension"):
        one_pass(k[:3, :16], k)
    with pytest.raises(DatagenError, match="index kind"):
        extremes(k[:3], k, "hnsw")
    ex = one_pass(k[:0], k)
    assert ex.top.shape == ex.bottom.shape == ex.top_score.shape == (0,)


def test_ivf_path_still_searches_both_ends():
    rng = np.random.default_rng(7)
    q, k = _unit(rng, 30), _unit(rng, 1500)
    full = extremes(q, k, "ivf", nlist=8, nprobe=8)      # probing every list is exact
    exact = one_pass(q, k)
    np.testing.assert_array_equal(full.top, exact.top)
    np.testing.assert_array_equal(full.bottom, exact.bottom)
    approx = extremes(q, k, "ivf", nlist=8, nprobe=1)
    assert np.all(approx.top_score <= exact.top_score + 1e-5) and np.all(approx.bottom_score >= exact.bottom_score - 1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_worker_threads_give_the_same_answer_and_restore_the_thread_count(threads):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    q, k = _ints(rng, 45), _ints(rng, 90)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _assert_numpy(one_pass(q, k, query_block=4, key_block=16), q, k)   # 12 blocks: uneven shares rebalanced
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


def test_calls_from_several_threads_are_exact_and_restore_the_thread_count():
    """Four threads searching at once (each sets torch's process-wide thread count to 1 while its workers run):
    every answer is exact and the process keeps its thread count."""
    from concurrent.futures import ThreadPoolExecutor

    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    q, k = _ints(rng, 64), _ints(rng, 400)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with ThreadPoolExecutor(4) as pool:
            found = list(pool.map(lambda _: one_pass(q, k, query_block=4, key_block=8), range(8)))
        for ex in found:
            _assert_numpy(ex, q, k)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
