"""Judge aggregates (docs/ARCHITECTURE.md "Taxonomy"): per-aspect means over judge calls, AvgSimple (mean of the aspect means),
AvgWeighted (mean over all calls), AvgS(noMT) (aspects without multi_turn), per aspect side and per task;
each with a 95% CI from a stratified bootstrap of test items (an item's calls stay together; items are
resampled within their task, so every resample has every task, aspect and dimension of the run). Beside them
`damaged`: the share of judged items whose reply is damaged (eval.damage), with its CI the same way."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

from rolemrc.core.stats import percentile_ci, percentile_cis, resample_counts
from rolemrc.core.taxonomy import DIMENSIONS

AVERAGES = ("AvgSimple", "AvgWeighted", "AvgS(noMT)")


def aspect_key(verdict: dict[str, Any]) -> str:
    return verdict["dimension"] + (f"/{verdict['detail']}" if verdict.get("detail") else "")


def _order(key: str) -> tuple[int, str]:
    head = key.split("/")[0]
    return DIMENSIONS.index(head) if head in DIMENSIONS else len(DIMENSIONS), key


def _onehot(keys: list[str]) -> tuple[list[str], np.ndarray]:
    """Group names in taxonomy order and the [rows, groups] membership matrix."""
    names = sorted(set(keys), key=_order)
    onehot = np.zeros((len(keys), len(names)))
    onehot[np.arange(len(keys)), [names.index(k) for k in keys]] = 1
    return names, onehot


def _group_means(w: np.ndarray, scores: np.ndarray, rows_item: np.ndarray, onehot: np.ndarray) -> np.ndarray:
    """Weighted mean score per group: [rounds, groups] (NaN where a group has no weight)."""
    rw = w[:, rows_item]                        # weight of each verdict row
    with np.errstate(invalid="ignore", divide="ignore"):
        return (rw * scores) @ onehot / (rw @ onehot)


def _averages(dim_means: np.ndarray, dims: list[str], weighted: np.ndarray) -> np.ndarray:
    """[rounds, 3]: AvgSimple (mean of the dimension means), AvgWeighted, AvgS(noMT)."""
    no_mt = [j for j, d in enumerate(dims) if d != "multi_turn"]
    simple = dim_means.mean(1) if dims else weighted
    no_mt_mean = dim_means[:, no_mt].mean(1) if no_mt else np.full(len(weighted), math.nan)
    return np.stack([simple, weighted, no_mt_mean], 1)


def _strata(scored: list[dict[str, Any]], items: list[str]) -> np.ndarray:
    """Stratum of each item: its task and the aspects it has scores for (the same for every item of a task
    unless some of its calls went unscored), so a within-stratum resample never loses an aspect."""
    aspects: dict[str, set[str]] = {}
    tasks: dict[str, str] = {}
    for v in scored:
        aspects.setdefault(v["id"], set()).add(aspect_key(v))
        tasks[v["id"]] = str(v.get("task") or "")
    return np.array([f"{tasks[i]}|{','.join(sorted(aspects[i]))}" for i in items])


def damage_by_item(verdicts: list[dict[str, Any]]) -> dict[str, str | None]:
    """Item id -> the damage kind its verdicts carry (eval.damage.KINDS), None for an intact reply."""
    kinds: dict[str, str | None] = {}
    for v in verdicts:
        kinds[v["id"]] = kinds.get(v["id"]) or v.get("damage")
    return kinds


def damaged(verdicts: list[dict[str, Any]], rounds: int, seed: int) -> dict[str, Any]:
    """The share of judged items whose reply is damaged (each failed on every aspect unjudged), with a 95% CI from
    a bootstrap of items within their task, and the count per damage kind."""
    kinds = damage_by_item(verdicts)
    if not kinds:
        return {}
    tasks = {v["id"]: str(v.get("task") or "") for v in verdicts}
    items = sorted(kinds)
    flags = np.array([kinds[i] is not None for i in items], dtype=np.float64)
    weights = resample_counts(len(items), rounds, seed, np.array([tasks[i] for i in items]))
    lo, hi = percentile_ci(weights @ flags / len(items))     # a stratified resample keeps the item count
    return {"mean": float(flags.mean()), "lo": lo, "hi": hi, "n": len(items),
            "kinds": dict(Counter(k for k in kinds.values() if k))}


def aggregate(verdicts: list[dict[str, Any]], *, rounds: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Aggregates with CIs from verdict dicts; verdicts without a score are counted, never scored."""
    scored = [v for v in verdicts if v.get("score") is not None]
    status = Counter(v.get("status", "ok") for v in verdicts)
    out: dict[str, Any] = {"calls": len(verdicts), "scored": len(scored), "status": dict(status),
                           "damaged": damaged(verdicts, rounds, seed)}
    if not scored:
        return out | {"dimensions": {}, "aspects": {}, "tasks": {}, "averages": {}}
    items = sorted({v["id"] for v in scored})
    index = {item: k for k, item in enumerate(items)}
    rows_item = np.array([index[v["id"]] for v in scored])
    scores = np.array([float(v["score"]) for v in scored])
    strata = _strata(scored, items)
    weights = np.vstack([np.ones((1, len(items))), resample_counts(len(items), rounds, seed, strata)])

    def table(names: list[str], onehot: np.ndarray) -> tuple[dict[str, dict], np.ndarray]:
        means = _group_means(weights, scores, rows_item, onehot)       # row 0: the point estimate
        lo, hi = percentile_cis(means[1:])
        return {name: {"mean": float(means[0, j]), "lo": float(lo[j]), "hi": float(hi[j]), "n": int(onehot[:, j].sum())}
                for j, name in enumerate(names)}, means

    dims, dim_onehot = _onehot([v["dimension"] for v in scored])
    out["dimensions"], dim_means = table(dims, dim_onehot)
    out["aspects"] = table(*_onehot([aspect_key(v) for v in scored]))[0]
    out["tasks"] = table(*_onehot([str(v["task"]) for v in scored]))[0]
    weighted = (weights[:, rows_item] * scores).sum(1) / weights[:, rows_item].sum(1)
    avg = _averages(dim_means, dims, weighted)
    lo, hi = percentile_cis(avg[1:])
    out["averages"] = {name: {"mean": float(avg[0, j]), "lo": float(lo[j]), "hi": float(hi[j])}
                       for j, name in enumerate(AVERAGES)}
    out["bootstrap"] = {"rounds": rounds, "strata": "task (+ the aspects an item has scores for)",
                        "n_strata": int(np.unique(strata).size),
                        "resamples_lacking_dimension": int(np.isnan(dim_means[1:]).any(1).sum())}
    missing = [d for d in DIMENSIONS if d not in dims]
    if missing:
        out["averages_note"] = f"AvgSimple/AvgS(noMT) average the dimensions present; no scored calls for {missing}"
    return out
