"""Retrieval benchmark: most and least relevant triplet for every profile at RoleMRC scale.

10.2k profile vectors against 808.7k triplet vectors (random unit vectors, dim 384, float32). Side
by side in one run: the exact one-pass search that `datagen` uses (both ends from one matmul), one
faiss exact top-1 search (what a single search of the old two-search path cost), and the rates of
plain numpy and torch matmuls on a slice of the same problem. Both ends of the one-pass result are
checked against numpy brute force on a sample of queries. With `kind="ivf"` the faiss IVF path is
also built and timed, and its recall@1 at both ends is measured against the exact result.
"""

from __future__ import annotations

import time

import numpy as np

from rolemrc.datagen.config import INDEXES, DatagenError
from rolemrc.datagen.retrieval import KEY_BLOCK, QUERY_BLOCK, Extremes, build_index, one_pass, search_extremes, top1

TARGET_RATIO = 1.1  # one-pass (both ends) seconds / one faiss exact top-1 search seconds


def unit_vectors(rng: np.random.Generator, n: int, dim: int, *, block: int = 65_536) -> np.ndarray:
    """n random unit vectors, generated in blocks (no full-size temporaries)."""
    x = np.empty((n, dim), dtype=np.float32)
    for i in range(0, n, block):
        part = rng.standard_normal((min(block, n - i), dim), dtype=np.float32)
        part /= np.linalg.norm(part, axis=1, keepdims=True)
        x[i:i + len(part)] = part
    return x


def matmul_rates(queries: np.ndarray, keys: np.ndarray, *, query_block: int = 2048, repeats: int = 3) -> dict[str, float]:
    """Best flops/s of `queries @ keys.T` with numpy and with torch, in query blocks (bounded memory)."""
    import torch

    tq, tk = torch.from_numpy(queries), torch.from_numpy(keys)
    calls = {"numpy": lambda a, b: np.matmul(queries[a:b], keys.T), "torch": lambda a, b: torch.mm(tq[a:b], tk.T)}
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            for i in range(0, len(queries), query_block):
                call(i, i + query_block)
            best[name] = min(best[name], time.perf_counter() - start)
    flops = 2.0 * len(queries) * len(keys) * queries.shape[1]
    return {name: flops / seconds for name, seconds in best.items()}


def brute_force(queries: np.ndarray, keys: np.ndarray, *, chunk: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """numpy argmax and argmin of `queries @ keys.T`, a few queries at a time."""
    found = [(s.argmax(1), s.argmin(1)) for s in (queries[i:i + chunk] @ keys.T for i in range(0, len(queries), chunk))]
    return np.concatenate([f[0] for f in found]), np.concatenate([f[1] for f in found])


def run(profiles: int = 10_200, triplets: int = 808_700, dim: int = 384, *, kind: str = "flat", seed: int = 0,
        query_block: int = QUERY_BLOCK, key_block: int = KEY_BLOCK, nlist: int = 0, nprobe: int = 8,
        matmul_keys: int = 32_768, check: int = 256, progress: bool = True) -> dict:
    """Time the one-pass exact search and one faiss top-1 search; return seconds, rates and checks."""
    import faiss
    import torch

    if kind not in INDEXES:
        raise DatagenError(f"index kind must be one of {INDEXES}, got {kind!r}")
    rng = np.random.default_rng(seed)
    queries = unit_vectors(rng, profiles, dim)
    keys = unit_vectors(rng, triplets, dim)
    flops = 2.0 * profiles * triplets * dim

    warm = build_index(dim, "flat")  # warm up the BLAS and thread pools of both paths before timing
    warm.add(keys[:2 * key_block])
    top1(warm, queries[:64])
    one_pass(queries[:64], keys[:2 * key_block], query_block=query_block, key_block=key_block)
    index = build_index(dim, "flat")
    index.add(keys)
    start = time.perf_counter()
    faiss_top, _ = top1(index, queries)
    single = time.perf_counter() - start
    del index

    start = time.perf_counter()
    exact = one_pass(queries, keys, query_block=query_block, key_block=key_block, progress=progress)
    both = time.perf_counter() - start

    rates = matmul_rates(queries, keys[:matmul_keys])
    ratio = both / single

    def timing(seconds: float) -> dict:
        return {"seconds": round(seconds, 3), "gflops": round(flops / seconds / 1e9, 2),
                "fraction_of_matmul": round(flops / seconds / rates["numpy"], 3)}

    sample = rng.choice(profiles, size=min(check, profiles), replace=False)
    want_top, want_bottom = brute_force(queries[sample], keys)
    result = {"profiles": profiles, "triplets": triplets, "dim": dim, "index": kind, "threads": torch.get_num_threads(),
              "faiss_threads": faiss.omp_get_max_threads(), "query_block": query_block, "key_block": key_block,
              "numpy_matmul_gflops": round(rates["numpy"] / 1e9, 2), "torch_matmul_gflops": round(rates["torch"] / 1e9, 2),
              "one_pass": timing(both), "single_search": timing(single),
              "one_pass_vs_single_search": round(ratio, 3), "target_ratio": TARGET_RATIO, "meets_target": ratio <= TARGET_RATIO,
              "checked_queries": len(sample),
              "exact": bool(np.array_equal(exact.top[sample], want_top) and np.array_equal(exact.bottom[sample], want_bottom)),
              "faiss_top_agreement": round(float(np.mean(faiss_top == exact.top)), 6)}
    if kind == "ivf":
        result["ivf"] = ivf_figures(queries, keys, exact, nlist=nlist, nprobe=nprobe)
    return result


def ivf_figures(queries: np.ndarray, keys: np.ndarray, exact: Extremes, *, nlist: int, nprobe: int) -> dict:
    """Build and search time of the faiss IVF path and its recall@1 at both ends against the exact result."""
    start = time.perf_counter()
    index = build_index(keys.shape[1], "ivf", train=keys, nlist=nlist, nprobe=nprobe)
    index.add(keys)
    built = time.perf_counter()
    approx = search_extremes(index, queries)
    searched = time.perf_counter()
    recall = {end: round(float(np.mean(getattr(approx, end) == getattr(exact, end))), 4) for end in ("top", "bottom")}
    return {"nlist": index.nlist, "nprobe": index.nprobe, "build_seconds": round(built - start, 3),
            "search_seconds": round(searched - built, 3), "recall_queries": len(queries),
            "recall_at_1": recall}
