"""Retrieval benchmark: most and least relevant triplet for every profile at RoleMRC scale.

10.2k profile vectors against 808.7k triplet vectors (random unit vectors, dim 384, float32). Side
by side in one run: the exact one-pass search that `datagen` uses (both ends from one matmul), one
faiss exact top-1 search (what a single search of the old two-search path cost), and the rate of a
plain numpy matmul on a slice of the same problem, taking turns on slices of the queries.
Both ends of the one-pass result are
checked against numpy brute force on a sample of queries. With `kind="ivf"` the faiss IVF path is
also built and timed, and its recall@1 at both ends is measured against the exact result.
"""

from __future__ import annotations

import time
from itertools import pairwise

import numpy as np
from tqdm.auto import tqdm

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


def brute_force(queries: np.ndarray, keys: np.ndarray, *, chunk: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """numpy argmax and argmin of `queries @ keys.T`, a few queries at a time."""
    found = [(s.argmax(1), s.argmin(1)) for s in (queries[i:i + chunk] @ keys.T for i in range(0, len(queries), chunk))]
    return np.concatenate([f[0] for f in found]), np.concatenate([f[1] for f in found])


def run(profiles: int = 10_200, triplets: int = 808_700, dim: int = 384, *, kind: str = "flat", seed: int = 0,
        query_block: int = QUERY_BLOCK, key_block: int = KEY_BLOCK, nlist: int = 0, nprobe: int = 8,
        rounds: int = 5, matmul_keys: int = 65_536, check: int = 256, progress: bool = True) -> dict:
    """Time the one-pass exact search, one faiss top-1 search and a plain matmul; return seconds, rates and checks.

    The queries are split into `rounds` slices and the three measurements take turns on each slice (order
    reversed every other round), so a change in machine load hits them alike.
    """
    import faiss
    import torch

    if kind not in INDEXES:
        raise DatagenError(f"index kind must be one of {INDEXES}, got {kind!r}")
    rng = np.random.default_rng(seed)
    queries = unit_vectors(rng, profiles, dim)
    keys = unit_vectors(rng, triplets, dim)
    mm_keys = keys[:matmul_keys]
    out = np.empty((min(1024, profiles), len(mm_keys)), dtype=np.float32)  # preallocated: no page faults timed

    def chunks(a: int, b: int):
        return ((i, min(i + len(out), b)) for i in range(a, b, len(out)))

    warm = build_index(dim, "flat")  # warm up the BLAS and thread pools of every path before timing
    warm.add(keys[:2 * key_block])
    top1(warm, queries[:64])
    one_pass(queries[:64], keys[:2 * key_block], query_block=query_block, key_block=key_block)
    index = build_index(dim, "flat")
    index.add(keys)

    found: dict[str, list] = {"single_search": [], "one_pass": []}
    steps = {"single_search": lambda a, b: found["single_search"].append(top1(index, queries[a:b])[0]),
             "one_pass": lambda a, b: found["one_pass"].append(
                 one_pass(queries[a:b], keys, query_block=query_block, key_block=key_block)),
             "numpy": lambda a, b: [np.matmul(queries[i:j], mm_keys.T, out=out[:j - i]) for i, j in chunks(a, b)]}
    seconds = dict.fromkeys(steps, 0.0)
    bounds = np.linspace(0, profiles, max(1, min(rounds, profiles)) + 1).astype(int)
    for r, (a, b) in enumerate(tqdm(list(pairwise(bounds)), desc="rounds", disable=not progress, leave=False)):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            start = time.perf_counter()
            steps[name](a, b)
            seconds[name] += time.perf_counter() - start
    index.reset()  # frees its copy of the keys
    faiss_top = np.concatenate(found["single_search"])
    exact = Extremes(*(np.concatenate([getattr(e, f) for e in found["one_pass"]]) for f in Extremes.__dataclass_fields__))

    flops = 2.0 * profiles * triplets * dim
    mm_rate = 2.0 * profiles * len(mm_keys) * dim / seconds["numpy"]
    ratio = seconds["one_pass"] / seconds["single_search"]

    def timing(name: str) -> dict:
        rate = flops / seconds[name]
        return {"seconds": round(seconds[name], 3), "gflops": round(rate / 1e9, 2),
                "fraction_of_matmul": round(rate / mm_rate, 3)}

    sample = rng.choice(profiles, size=min(check, profiles), replace=False)
    want_top, want_bottom = brute_force(queries[sample], keys)
    result = {"profiles": profiles, "triplets": triplets, "dim": dim, "index": kind, "threads": torch.get_num_threads(),
              "faiss_threads": faiss.omp_get_max_threads(), "query_block": query_block, "key_block": key_block,
              "rounds": len(bounds) - 1, "numpy_matmul_gflops": round(mm_rate / 1e9, 2),
              "one_pass": timing("one_pass"), "single_search": timing("single_search"),
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
