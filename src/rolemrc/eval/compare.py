"""Paired comparison of two scored runs on their shared items: exact McNemar per judge dimension
(and over all calls), with a CI of the change that resamples items, and on damaged replies; per reference metric a
paired bootstrap CI and a sign-flip permutation p; effect sizes; the dimension B cost most."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rolemrc.core.stats import bootstrap, mcnemar_outcomes, paired_test
from rolemrc.core.taxonomy import DIMENSIONS
from rolemrc.eval.aggregate import damage_by_item
from rolemrc.eval.runs import EvalRun, RunError


@dataclass
class Comparison:
    """Result of compare(a, b): `verdicts` (dimension or "all" -> McNemar), `metrics` (name -> core.stats.paired_test),
    `damaged` (McNemar on the items' damaged replies, `improved` counting those damaged under B only; empty when a run
    predates the damage check). Each verdict row's `lo`/`hi` is the 95% CI of its change B - A, items resampled."""

    a: str
    b: str
    shared_items: int
    verdicts: dict[str, dict[str, Any]]
    metrics: dict[str, dict[str, Any]]
    runs: tuple[dict[str, Any], dict[str, Any]]
    damaged: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "shared_items": self.shared_items, "verdicts": self.verdicts,
                "metrics": self.metrics, "damaged": self.damaged, "costliest": self.costliest()}

    def costliest(self) -> dict[str, Any] | None:
        """The judge dimension whose pass rate fell most from A to B: {dimension, diff, lo, hi, p, excludes_zero}
        (`excludes_zero`: its CI lies wholly below 0); None without a judged dimension."""
        rows = {d: r for d, r in self.verdicts.items() if d != "all"}
        if not rows:
            return None
        dim = min(rows, key=lambda d: rows[d]["diff"])
        r = rows[dim]
        return {"dimension": dim, "diff": r["diff"], "lo": r["lo"], "hi": r["hi"], "p": r["p"],
                "excludes_zero": bool(r["hi"] < 0)}

    def save(self, out: str | os.PathLike, *, chart: bool = True) -> Path:
        from rolemrc.eval.report import compare_markdown, write_chart

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        data = self.to_dict()
        if chart:
            data["chart"] = write_chart([(self.a, self.runs[0]), (self.b, self.runs[1])], out / "compare")
        (out / "compare.json").write_text(json.dumps(data, indent=1))
        (out / "compare.md").write_text(compare_markdown(self))
        return out


def _as_run(run: EvalRun | str | os.PathLike) -> EvalRun:
    return run if isinstance(run, EvalRun) else EvalRun.load(run)


def compare(run_a: EvalRun | str | os.PathLike, run_b: EvalRun | str | os.PathLike, *, rounds: int = 10_000,
            seed: int = 0) -> Comparison:
    """Compare run B against run A (e.g. before/after a restraint) on items both scored.

    Verdicts pair on (id, dimension, detail) where both runs have a score; metrics pair on id."""
    a, b = _as_run(run_a), _as_run(run_b)
    shared = {i["id"] for i in a.items} & {i["id"] for i in b.items}
    if not shared:
        raise RunError("the two runs share no item ids; compare needs the same test items")

    def keyed(verdicts):
        return {(v["id"], v["dimension"], v.get("detail")): v["score"] for v in verdicts
                if v["id"] in shared and v.get("score") is not None}

    va, vb = keyed(a.verdicts), keyed(b.verdicts)
    pairs = sorted(set(va) & set(vb), key=str)
    verdicts = {}
    for dim in (*DIMENSIONS, "all"):
        keys = [k for k in pairs if dim in ("all", k[1])]
        if keys:
            verdicts[dim] = mcnemar_outcomes([va[k] for k in keys], [vb[k] for k in keys]) | \
                dict(zip(("lo", "hi"), item_resampled_ci(keys, va, vb, rounds=rounds, seed=seed)))
    ma, mb = ({m["id"]: m for m in run.metrics if m["id"] in shared} for run in (a, b))
    ids = sorted(set(ma) & set(mb))
    names = [n for n in (ma[ids[0]] if ids else {}) if n != "id" and all(n in mb[i] and n in ma[i] for i in ids)]
    metrics = {n: paired_test([ma[i][n] for i in ids], [mb[i][n] for i in ids], rounds=rounds, seed=seed)
               for n in names}
    label = lambda run, default: str(run.path) if run.path else default  # noqa: E731
    return Comparison(label(a, "A"), label(b, "B"), len(shared), verdicts, metrics, (a.summary, b.summary),
                      compare_damage(a, b, shared))


def item_resampled_ci(keys: list[tuple], va: dict, vb: dict, *, rounds: int, seed: int) -> tuple[float, float]:
    """95% CI of the pass-rate change B - A over the verdicts `keys` ((id, dimension, detail)), resampling items: an
    item's verdicts are drawn together, so several aspects of one reply do not count as independent evidence."""
    items, index = np.unique([k[0] for k in keys], return_inverse=True)
    change = np.bincount(index, weights=[vb[k] - va[k] for k in keys], minlength=items.size)
    counts = np.bincount(index, minlength=items.size).astype(np.float64)
    return bootstrap(lambda w: (w @ change) / (w @ counts), items.size, rounds=rounds, seed=seed)


def compare_damage(a: EvalRun, b: EvalRun, shared: set[str]) -> dict[str, Any]:
    """McNemar on damaged (1) / intact (0) replies of the shared items both runs judged; {} when either run's
    verdicts predate the damage check (no `damage` field)."""
    if not all("damage" in v for run in (a, b) for v in run.verdicts):
        return {}
    ka, kb = damage_by_item(a.verdicts), damage_by_item(b.verdicts)
    ids = sorted(shared & set(ka) & set(kb))
    return mcnemar_outcomes([int(ka[i] is not None) for i in ids], [int(kb[i] is not None) for i in ids]) if ids else {}
