"""Judge aggregates (docs/ARCHITECTURE.md "Taxonomy"): per-aspect means over judge calls, AvgSimple (mean of the aspect means),
AvgWeighted (mean over all calls), AvgS(noMT) (aspects without multi_turn), per aspect side and per task;
each with a bootstrap 95% CI from resampling test items (an item's calls stay together)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

from rolemrc.core.taxonomy import DIMENSIONS
from rolemrc.eval.stats import bootstrap


def aspect_key(verdict: dict[str, Any]) -> str:
    return verdict["dimension"] + (f"/{verdict['detail']}" if verdict.get("detail") else "")


def _group_means(w: np.ndarray, scores: np.ndarray, rows_item: np.ndarray, onehot: np.ndarray) -> np.ndarray:
    """Weighted mean score per group: [rounds, groups]."""
    rw = w[:, rows_item]                        # weight of each verdict row
    return (rw * scores) @ onehot / (rw @ onehot)


def aggregate(verdicts: list[dict[str, Any]], *, rounds: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Aggregates with CIs from verdict dicts; verdicts without a score are counted, never scored."""
    scored = [v for v in verdicts if v.get("score") is not None]
    status = Counter(v.get("status", "ok") for v in verdicts)
    out: dict[str, Any] = {"calls": len(verdicts), "scored": len(scored), "status": dict(status)}
    if not scored:
        return out | {"dimensions": {}, "aspects": {}, "tasks": {}, "averages": {}}
    items = sorted({v["id"] for v in scored})
    index = {item: k for k, item in enumerate(items)}
    rows_item = np.array([index[v["id"]] for v in scored])
    scores = np.array([float(v["score"]) for v in scored])

    def summarise(keys: list[str]) -> tuple[list[str], np.ndarray]:
        names = sorted(set(keys), key=lambda k: (DIMENSIONS.index(k.split("/")[0]) if k.split("/")[0] in DIMENSIONS else 99, k))
        onehot = np.zeros((len(scored), len(names)))
        onehot[np.arange(len(scored)), [names.index(k) for k in keys]] = 1
        return names, onehot

    def table(names: list[str], onehot: np.ndarray) -> dict[str, dict]:
        point = _group_means(np.ones((1, len(items))), scores, rows_item, onehot)[0]
        lohi = [bootstrap(lambda w, j=j: _group_means(w, scores, rows_item, onehot[:, [j]])[:, 0], len(items),
                          rounds=rounds, seed=seed) for j in range(len(names))]
        return {name: {"mean": float(point[j]), "lo": lohi[j][0], "hi": lohi[j][1], "n": int(onehot[:, j].sum())}
                for j, name in enumerate(names)}

    dims, dim_onehot = summarise([v["dimension"] for v in scored])
    out["dimensions"] = table(dims, dim_onehot)
    out["aspects"] = table(*summarise([aspect_key(v) for v in scored]))
    out["tasks"] = table(*summarise([v["task"] for v in scored]))

    def averages(w: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            means = _group_means(w, scores, rows_item, dim_onehot)
            no_mt = [j for j, d in enumerate(dims) if d != "multi_turn"]
            weighted = (w[:, rows_item] * scores).sum(1) / w[:, rows_item].sum(1)
            return np.stack([np.nanmean(means, 1) if dims else weighted, weighted,
                             np.nanmean(means[:, no_mt], 1) if no_mt else np.full(len(w), math.nan)], 1)

    point = averages(np.ones((1, len(items))))[0]
    names = ("AvgSimple", "AvgWeighted", "AvgS(noMT)")
    out["averages"] = {}
    for j, name in enumerate(names):
        lo, hi = bootstrap(lambda w, j=j: averages(w)[:, j], len(items), rounds=rounds, seed=seed)
        out["averages"][name] = {"mean": float(point[j]), "lo": lo, "hi": hi}
    missing = [d for d in DIMENSIONS if d not in dims]
    if missing:
        out["averages_note"] = f"AvgSimple/AvgS(noMT) average the dimensions present; no scored calls for {missing}"
    return out
