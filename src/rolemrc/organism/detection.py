"""Where a change lives: how well each selector's ranking finds the units organism's known units S (known.py).

Every selector of `probe.selectors.SELECTORS` gives each unit of the hook point a score
(`intervene.select.scores_of`), ranked as `select` ranks them: |score| descending, then q ascending (`probe.ranking.
rank_units`); units equal in both are tied. Against S:
- AUROC over all units: the chance that a unit of S ranks above one outside it, ties counting half (Mann-Whitney
  with average ranks); 0.5 is chance, 1 every unit of S first, 0 every unit of S last.
- precision at |S|: the share of the first |S| units that are in S; recall at 4|S|: the share of S among the first
  4|S|. A tie group across the cut counts in expectation over its order (its share of S times the places left).
Per seed (a units organism, with its own S, per seed), and over seeds the mean with a 95% t-interval and a verdict:
a selector beats chance only where its AUROC interval lies above 0.5.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rolemrc.core.stats import t_interval
from rolemrc.organism.calibration_config import Organism
from rolemrc.organism.config import OrganismError
from rolemrc.organism.known import Units

METRICS = ("auroc", "precision_at_s", "recall_at_4s")
CHANCE_AUROC = 0.5


def labels_of(known: Units, shape: tuple[int, int]) -> torch.Tensor:
    """Bool [layers, width]: True on S."""
    labels = torch.zeros(shape, dtype=torch.bool)
    for layer, units in known.items():
        if layer >= shape[0] or max(units) >= shape[1]:
            raise OrganismError(f"the known units (layer {layer}: up to {max(units)}) lie outside the scores' "
                                f"{shape[0]} layers x {shape[1]} units")
        labels[layer, units] = True
    return labels


def ranking_key(score: torch.Tensor, q: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 [units], flat: higher for a unit the selector ranks earlier, equal exactly for units it cannot tell
    apart (equal |score| and equal q)."""
    from rolemrc.probe.ranking import rank_units

    flat = score.detach().reshape(-1).double().abs()
    q_key = (torch.full_like(flat, torch.nan) if q is None else q.detach().reshape(-1).double()).nan_to_num(torch.inf)
    order = rank_units(flat, q_key)
    new = torch.ones(len(order), dtype=torch.bool)
    new[1:] = (flat[order][1:] != flat[order][:-1]) | (q_key[order][1:] != q_key[order][:-1])
    key = torch.empty_like(flat)
    key[order] = -(new.cumsum(0) - 1).double()
    return key


def auroc(key: torch.Tensor, labels: torch.Tensor) -> float:
    """P(key of a positive > key of a negative) + P(equal) / 2, by the rank-sum with average ranks of ties."""
    key, labels = key.reshape(-1).double(), labels.reshape(-1)
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if not positives or not negatives:
        raise OrganismError(f"AUROC needs units in S and outside it (got {positives} and {negatives})")
    _, inverse, counts = torch.unique(key, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    ranks = ((ends - counts + 1 + ends) / 2)[inverse]   # 1-based, each tie group at its average rank
    return float((ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def hits_at(key: torch.Tensor, labels: torch.Tensor, k: int) -> float:
    """Units of S among the first `k` by `key` (descending), a tie group across the cut counted in expectation."""
    key, labels = key.reshape(-1).double(), labels.reshape(-1)
    _, inverse, counts = torch.unique(-key, return_inverse=True, return_counts=True)   # groups best first
    positives = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, labels.double())
    before = counts.cumsum(0) - counts
    taken = (k - before).clamp(min=0).minimum(counts)
    return float((taken * positives / counts).sum())


def unit_detection(score: torch.Tensor, q: torch.Tensor | None, labels: torch.Tensor) -> dict[str, float]:
    """AUROC, precision at |S| and recall at 4|S| of one selector's scores against S, with each one's chance level."""
    key = ranking_key(score, q)
    size, total = int(labels.sum()), labels.numel()
    return {"auroc": auroc(key, labels), "precision_at_s": hits_at(key, labels, size) / size,
            "recall_at_4s": hits_at(key, labels, 4 * size) / size, "units_in_s": size, "units": total,
            "chance": {"auroc": CHANCE_AUROC, "precision_at_s": size / total, "recall_at_4s": min(1.0, 4 * size / total)}}


def detect(inputs: dict[str, str], dimension: str, known: Units,
           selectors: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """selector -> its detection of S in `dimension`; `inputs`: calibration input kind (`Selector.calibrated_on`) ->
    path, as `calibration.probe_stages` gives them. Every selector of `probe.selectors` unless `selectors` names some."""
    from rolemrc.core.hooks import hook_point
    from rolemrc.intervene.select import scores_of
    from rolemrc.probe.selectors import SELECTORS

    out = {}
    for name in selectors or list(SELECTORS.names()):
        scores = scores_of(name, Path(inputs[SELECTORS.get(name).calibrated_on]), dimension)
        if hook_point(scores.hook).width != "intermediate":
            raise OrganismError(f"{scores.origin}: scores at {scores.hook}, whose units are not the MLP's; the known "
                                "units are (probe at mlp.act or mlp.post)")
        out[name] = unit_detection(scores.score, scores.q, labels_of(known, tuple(scores.score.shape)))
    return out


def verdict(interval: dict[str, float | None]) -> str:
    """Whether an AUROC interval says the selector finds S better than chance."""
    lo, hi = interval["lo"], interval["hi"]
    if lo is None or hi is None:
        return f"not tested against chance (one seed: AUROC {interval['mean']:.2f}); run 3 seeds or more"
    if lo > CHANCE_AUROC:
        return f"beats chance (AUROC {interval['mean']:.2f}, 95% CI {lo:.2f} to {hi:.2f})"
    if hi < CHANCE_AUROC:
        return f"worse than chance: ranks S last (AUROC {interval['mean']:.2f}, 95% CI {lo:.2f} to {hi:.2f})"
    return f"does not beat chance (AUROC {interval['mean']:.2f}, 95% CI {lo:.2f} to {hi:.2f} contains 0.5)"


def aggregate(per_seed: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """selector -> per metric the mean over seeds with its 95% t-interval, and the AUROC verdict."""
    out = {}
    for name in dict.fromkeys(s for seed in per_seed for s in seed):
        rows = [seed[name] for seed in per_seed if name in seed]
        summary: dict[str, Any] = {m: t_interval([r[m] for r in rows]) for m in METRICS}
        summary["chance"] = rows[0]["chance"]
        summary["verdict"] = verdict(summary["auroc"])
        out[name] = summary
    return out


def seed_row(seed: int, selectors: dict[str, dict[str, Any]], meets_target: bool, organism: str) -> dict[str, Any]:
    """One seed's detection: every selector's (`detect`), and whether its units organism met its behavioural target
    (`organism`: its headline). One that missed is read all the same: S still carries its whole update (carrier.py)."""
    return {"seed": seed, "selectors": selectors, "meets_target": meets_target, "organism": organism}


def organism_detection(organism: Organism, inputs: dict[str, str], seed: int,
                       selectors: list[str] | None = None) -> dict[str, Any]:
    """The `seed_row` of a units organism whose selector inputs (`calibration.probe_stages`) are `inputs`."""
    from rolemrc.intervene.inputs import units_of

    return seed_row(seed, detect(inputs, organism.dimension, units_of(organism.known_units), selectors),
                    organism.meets_target, organism.headline)


def detection_summary(per_seed: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """A calibration's detection: per units organism kind, each seed's row (`seed_row`) and their `aggregate`."""
    kinds = dict.fromkeys(k for seed in per_seed for k in seed)
    return {k: {"per_seed": [seed[k] for seed in per_seed if k in seed],
                "summary": aggregate([seed[k]["selectors"] for seed in per_seed if k in seed])} for k in kinds}


def headline(summary: dict[str, dict[str, Any]]) -> str:
    return "; ".join(f"{name} {s['verdict']}" for name, s in summary.items())
