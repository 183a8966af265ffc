"""Retrieval benchmark: most and least relevant triplet for every profile at RoleMRC scale.

10.2k profile vectors against 808.7k triplet vectors (random unit vectors, dim 384, float32),
through the same faiss inner-product index and top1/bottom1 calls that `datagen` uses. Each
search is timed and its achieved rate (2*P*T*d flops / seconds) is compared with the rate of a
plain numpy matmul measured in the same run on a slice of the same problem. A sample of queries
is checked against brute force.
"""

from __future__ import annotations

import time

import numpy as np
from tqdm.auto import tqdm

from rolemrc.datagen.retrieval import bottom1, build_index, top1


def unit_vectors(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    x = rng.standard_normal((n, dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def matmul_rate(queries: np.ndarray, keys: np.ndarray, *, query_block: int = 2048, repeats: int = 3) -> float:
    """Best flops/s of `queries @ keys.T`, done in query blocks (bounded memory)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(0, len(queries), query_block):
            np.matmul(queries[i:i + query_block], keys.T)
        best = min(best, time.perf_counter() - start)
    return 2.0 * len(queries) * len(keys) * queries.shape[1] / best


def run(profiles: int = 10_200, triplets: int = 808_700, dim: int = 384, *, kind: str = "flat", seed: int = 0,
        add_block: int = 65_536, matmul_keys: int = 32_768, check: int = 64, progress: bool = True) -> dict:
    """Time top-1 and bottom-1 search; return seconds, rates and their fraction of the numpy matmul rate."""
    import faiss

    rng = np.random.default_rng(seed)
    queries = unit_vectors(rng, profiles, dim)
    first = unit_vectors(rng, min(add_block, triplets), dim)
    index = build_index(dim, kind, train=first)
    index.add(first)
    with tqdm(total=triplets, initial=len(first), desc="keys", unit="vec", disable=not progress) as bar:
        while index.ntotal < triplets:
            block = unit_vectors(rng, min(add_block, triplets - index.ntotal), dim)
            index.add(block)
            bar.update(len(block))
    sample_keys = first[: min(matmul_keys, len(first))]
    mm_rate = matmul_rate(queries, sample_keys)
    flops = 2.0 * profiles * triplets * dim
    result = {"profiles": profiles, "triplets": triplets, "dim": dim, "index": kind,
              "threads": faiss.omp_get_max_threads(), "numpy_matmul_gflops": round(mm_rate / 1e9, 2)}
    found = {}
    for name, search in (("top1", top1), ("bottom1", bottom1)):
        start = time.perf_counter()
        found[name] = search(index, queries)
        seconds = time.perf_counter() - start
        rate = flops / seconds
        result[name] = {"seconds": round(seconds, 3), "gflops": round(rate / 1e9, 2),
                        "fraction_of_matmul": round(rate / mm_rate, 3)}
    if kind == "flat" and check:
        keys = faiss.rev_swig_ptr(index.get_xb(), index.ntotal * dim).reshape(index.ntotal, dim)
        scores = queries[:check] @ keys.T
        result["checked_queries"] = check
        result["exact"] = bool(np.array_equal(found["top1"][0][:check], scores.argmax(1))
                               and np.array_equal(found["bottom1"][0][:check], scores.argmin(1)))
    result["target_fraction"] = 0.5
    result["meets_target"] = all(result[n]["fraction_of_matmul"] >= 0.5 for n in ("top1", "bottom1"))
    return result
