"""`--measure kl`: a cell is one teacher-forced forward pass per case (`eval.divergence.kl_grid`, every pending cell
on the same batches), kept in the cell store as per-case KL to the base model; its item scores are each case's share
of the DPO model's KL undone, per dimension, and each neutral text's perplexity."""

from __future__ import annotations

import math
from typing import Any

import torch

from rolemrc.core.taxonomy import dimensions_for_task
from rolemrc.eval.divergence import KLResult, continuations, kl_grid, restoration
from rolemrc.sweep.plan import Cell, SweepConfig, cell_id, neutral_texts
from rolemrc.sweep.stats import NEUTRAL_PPL, RESTORATION_PREFIX, Scores

NEUTRAL_ID = "neutral-"   # row ids of the neutral texts, by position: neutral-0, neutral-1, ...


def continuation_texts(config: SweepConfig, records: list[dict], store: Any, settings: dict[str, Any], sft: Any,
                       dpo: Any, tok: Any, progress: bool) -> list[str]:
    """The continuation of each record (`config.continuation`), kept in the store as a cell of its own."""
    from rolemrc.eval.generate import GenerateConfig

    cell = Cell(cell_id("continuation", None, settings), "continuation", {}, None)
    if not store.done(cell):
        replier = config.base if config.continuation == "sft" else config.model
        generate = GenerateConfig(model=replier, max_new_tokens=config.max_new_tokens, batch_size=config.batch_size,
                                  progress=progress)
        texts = continuations(records, config.continuation, sft=sft, dpo=dpo, tokenizer=tok, config=generate)
        store.save(cell, [{"id": r["id"], "continuation": t} for r, t in zip(records, texts)])
    return [row["continuation"] for row in store.load(cell)]


def measure_cells(config: SweepConfig, pending: list[Cell], store: Any, settings: dict[str, Any], model: Any, tok: Any,
                  records: list[dict], progress: bool) -> None:
    """KL to the base model of every pending cell, per case and per neutral text, saved in the store."""
    from rolemrc.core.modeling import load_model

    sft, _ = load_model(config.base, dtype=config.dtype, device=config.device)
    texts = continuation_texts(config, records, store, settings, sft, model, tok, progress)
    neutral = neutral_texts(config.neutral) if config.neutral else []
    result = kl_grid(sft, model, tok, records, texts, [c.restraint for c in pending], batch_size=config.batch_size,
                     neutral=neutral, progress=progress)
    for k, cell in enumerate(pending):
        store.save(cell, [{"id": r["id"], "task": r.get("task"), "kl": float(result.kl[k, i]),
                           "tokens": int(result.tokens[i])} for i, r in enumerate(records)]
                   + [{"id": f"{NEUTRAL_ID}{j}", "nll": float(result.neutral[k, j])} for j in range(len(neutral))])


def stored_result(rows: list[list[dict]]) -> KLResult:
    """The KLResult of stored cells' rows, the first the baseline (the DPO model)."""
    cases = [[r for r in cell if "kl" in r] for cell in rows]
    texts = [[r["nll"] for r in cell if "nll" in r] for cell in rows]
    kl = torch.tensor([[r["kl"] for r in cell] for cell in cases], dtype=torch.float64)
    neutral = torch.tensor(texts, dtype=torch.float64).reshape(len(rows), -1)
    return KLResult(kl, kl[0], torch.tensor([r["tokens"] for r in cases[0]]),
                    [dimensions_for_task(r["task"]) for r in cases[0]], neutral, neutral[0])


def case_ids(rows: list[dict]) -> list[str]:
    """The case ids of a stored cell's rows, in the KLResult's order."""
    return [r["id"] for r in rows if "kl" in r]


def kl_scores(cells: list[Cell], store: Any, items: set[str] | None = None) -> dict[str, Scores]:
    """cell id -> its item scores: per dimension `restoration:<dimension>`, each of its cases' share of the DPO model's
    KL undone ((d − c) / mean d: `eval.divergence.Restoration.per_case`, 0 for the baseline), and `neutral_ppl`, each
    neutral text's perplexity. `cells[0]` is the baseline. `items`: those cases and neutral texts alone (a half of
    them: `organism.halves`), the mean d taken over them."""
    rows = [store.load(c) for c in cells]
    result = stored_result(rows)
    ids = case_ids(rows[0])
    inside = torch.tensor([items is None or i in items for i in ids], dtype=torch.bool)
    scores: dict[str, Scores] = {c.id: {} for c in cells}
    for dimension in sorted({d for dims in result.dimensions for d in dims}):
        mask = result.mask(dimension) & inside
        if not mask.any():
            continue
        chosen = [ids[i] for i in mask.nonzero().squeeze(1).tolist()]
        for cell, shares in zip(cells, restoration(result, mask).per_case.tolist()):
            scores[cell.id][RESTORATION_PREFIX + dimension] = dict(zip(chosen, shares))
    texts = [j for j in range(result.neutral.shape[1]) if items is None or f"{NEUTRAL_ID}{j}" in items]
    if texts:
        for cell, nll in zip(cells, result.neutral.tolist()):
            scores[cell.id][NEUTRAL_PPL] = {f"{NEUTRAL_ID}{j}": math.exp(nll[j]) for j in texts}
    return scores


def kl_to_base(cells: list[Cell], store: Any) -> dict[str, float]:
    """dimension -> the DPO model's (the baseline's) mean KL per token to the base model on its cases."""
    result = stored_result([store.load(cells[0])])
    return {d: float(result.dpo[result.mask(d)].mean()) for d in sorted({d for dims in result.dimensions for d in dims})}
