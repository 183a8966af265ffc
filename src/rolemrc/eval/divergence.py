"""Continuous measures that need no generation: teacher-forced log-probabilities of a fixed continuation per case
under the SFT model, the DPO model and each cell (the DPO model with a restraint applied as runtime hooks), and the
exact full-vocabulary KL divergence of each to the SFT model at every continuation token.

    from rolemrc.core.modeling import load_model
    from rolemrc.core.records import read_records
    from rolemrc.eval.divergence import collateral, continuations, kl_grid, restoration
    from rolemrc.intervene import Restraint
    (sft, tok), (dpo, _) = load_model("runs/sft"), load_model("runs/dpo")
    records, _ = read_records("runs/data/test.jsonl")
    texts = continuations(records, "sft", sft=sft, tokenizer=tok)         # the SFT model's own greedy replies
    result = kl_grid(sft, dpo, tok, records, texts, [Restraint.load("runs/restraint.yaml"), None])
    restoration(result, result.mask("role_style")).value                  # [cells]: 1 - KL(cell||SFT)/KL(DPO||SFT)
    collateral(result, "role_style")                                      # the same on every other dimension

Batches stream: each batch runs through the SFT model once (its log-softmax kept for that batch only), then the DPO
model and every cell; KL is computed on the model's device and only per-case means leave it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from rolemrc.core.chat import tokenize_replies
from rolemrc.core.errors import InputError
from rolemrc.core.modeling import context_window, model_name
from rolemrc.core.records import normalize_record
from rolemrc.core.taxonomy import dimensions_for_task
from rolemrc.eval.generate import CONTINUATIONS, Continuation, GenerateConfig, generate_rows
from rolemrc.intervene.fit import validate
from rolemrc.intervene.runtime import applied
from rolemrc.intervene.spec import Restraint
from rolemrc.probe.cases import pad_right

log = logging.getLogger(__name__)


@dataclass
class KLResult:
    """Per case, in the order given: the mean over its continuation tokens of KL(· ‖ SFT), for each cell ([cells,
    cases]) and for the DPO model ([cases]); and, for the neutral texts, each text's mean negative log-likelihood per
    token under each cell ([cells, texts]) and under the DPO model ([texts])."""

    kl: torch.Tensor                 # float64 [cells, cases]
    dpo: torch.Tensor                # float64 [cases]
    tokens: torch.Tensor             # int64 [cases]: continuation tokens scored
    dimensions: list[tuple[str, ...]]   # each case's dimensions (core.taxonomy)
    neutral: torch.Tensor            # float64 [cells, texts]
    neutral_dpo: torch.Tensor        # float64 [texts]
    neutral_kl: torch.Tensor | None = None   # float64 [cells, texts]: mean KL(cell ‖ DPO) per token of each text

    def mask(self, dimension: str) -> torch.Tensor:
        """bool [cases]: the cases that count in `dimension`."""
        return torch.tensor([dimension in dims for dims in self.dimensions], dtype=torch.bool)


@dataclass
class Restoration:
    """1 − mean KL(cell‖SFT) / mean KL(DPO‖SFT) over a set of cases (`value`, [cells]: 1 where a cell is the SFT
    model, 0 where it is the DPO model), and per case (d_i − c_i) / mean(d) (`per_case`, [cells, cases]), whose mean
    over the cases is `value`, to bootstrap or test paired."""

    value: torch.Tensor
    per_case: torch.Tensor


def restoration(result: KLResult, mask: torch.Tensor) -> Restoration:
    """The share of the DPO model's divergence from the SFT model that each cell undoes on the cases `mask` marks."""
    d, c = result.dpo[mask], result.kl[:, mask]
    scale = d.mean()
    return Restoration(1 - c.mean(1) / scale, (d - c) / scale)


def collateral(result: KLResult, dimension: str) -> dict[str, Restoration]:
    """`restoration` on every other dimension's cases (those not counting in `dimension`), per dimension."""
    outside = ~result.mask(dimension)
    masks = {d: result.mask(d) & outside for d in sorted({d for dims in result.dimensions for d in dims})}
    return {d: restoration(result, mask) for d, mask in masks.items() if mask.any()}


def perplexity_change(result: KLResult) -> torch.Tensor:
    """[cells]: each cell's perplexity on the neutral texts (exp of the mean per-text NLL) minus the DPO model's."""
    return result.neutral.mean(1).exp() - result.neutral_dpo.mean().exp()


def canonical_cases(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Test records under any alias (`core.records`) as canonical ones: `question` turns, `reference`, `task`."""
    return [normalize_record(r, k + 1, "test", where=f"case {k}")[0] for k, r in enumerate(records)]


def continuations(records: Sequence[dict[str, Any]], source: Continuation, *, sft: Any = None, dpo: Any = None,
                  tokenizer: Any = None, config: GenerateConfig | None = None) -> list[str]:
    """The text scored after each record's prompt: the `reference`, or the greedy reply of the `sft` or `dpo` model
    (loaded; `config` an `eval.generate.GenerateConfig` for its length and batch, by default one naming the model's
    directory)."""
    if source not in CONTINUATIONS:
        raise InputError(f"continuation: one of {', '.join(CONTINUATIONS)}, not {source!r}")
    records = canonical_cases(records)
    if source == "reference":
        missing = [r.get("id") for r in records if not r.get("reference")]
        if missing:
            raise InputError(f"continuation reference: records without a reference, e.g. {missing[0]!r}")
        return [r["reference"] for r in records]
    model = {"sft": sft, "dpo": dpo}[source]
    if model is None or tokenizer is None:
        raise InputError(f"continuation {source}: pass the loaded {source} model and the tokenizer")
    config = config or GenerateConfig(model=model_name(model))
    return [row["response"] for row in generate_rows(model, tokenizer, records, [None] * len(records), config)]


@dataclass
class Batch:
    """Right-padded rows and which tokens are scored: `rows`, `cols` index the positions predicting them."""

    index: torch.Tensor      # [rows]: positions of the rows among the sequences
    input_ids: torch.Tensor
    mask: torch.Tensor
    rows: torch.Tensor       # [scored]
    cols: torch.Tensor       # [scored]: the position whose logits predict the token at cols + 1
    keep: int                # logits_to_keep: the last positions that hold every predicting position

    def to(self, device: torch.device) -> Batch:
        return Batch(self.index, self.input_ids.to(device), self.mask.to(device), self.rows.to(device),
                     self.cols.to(device), self.keep)

    def targets(self) -> torch.Tensor:
        """[scored]: the scored token ids."""
        return self.input_ids[self.rows, self.cols + 1]


def batches(seqs: list[list[int]], starts: list[int], batch_size: int, pad_id: int) -> Iterator[Batch]:
    """Batches of `batch_size` sequences, longest first; in sequence i the tokens from `starts[i]` on are scored."""
    if batch_size < 1:
        raise InputError(f"batch size must be >= 1, got {batch_size}")
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    for at in range(0, len(order), batch_size):
        idx = order[at:at + batch_size]
        input_ids, mask = pad_right([seqs[i] for i in idx], pad_id)
        begin = torch.tensor([max(1, starts[i]) for i in idx])
        positions = torch.arange(input_ids.shape[1])
        scored = mask.bool() & (positions >= begin[:, None])   # target tokens
        rows, targets = scored.nonzero(as_tuple=True)
        yield Batch(torch.tensor(idx), input_ids, mask, rows, targets - 1, input_ids.shape[1] - int(begin.min()) + 1)


def logprobs(model: Any, batch: Batch) -> torch.Tensor:
    """float32 [scored, vocab]: the model's log-softmax at the positions predicting the scored tokens."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.mask, logits_to_keep=batch.keep).logits
    offset = batch.input_ids.shape[1] - logits.shape[1]
    return logits[batch.rows, batch.cols - offset].float().log_softmax(-1)


def kl_to(reference: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """[scored]: KL(p ‖ q) over the vocabulary at each position, from log p (`lp`) and log q (`reference`)."""
    return F.kl_div(reference, lp, reduction="none", log_target=True).sum(-1)


def nll(targets: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """[scored]: −log p of each scored token."""
    return -lp.gather(1, targets[:, None]).squeeze(1)


def per_row_mean(values: torch.Tensor, batch: Batch, *, total: bool = False) -> torch.Tensor:
    """float64 [rows] on the CPU: the mean (`total`: the sum) of `values` ([scored]) over each row's scored tokens."""
    n = len(batch.index)
    summed = values.new_zeros(n, dtype=torch.float64).index_add(0, batch.rows, values.double())
    if total:
        return summed.cpu()
    count = values.new_zeros(n, dtype=torch.float64).index_add(0, batch.rows, torch.ones_like(values, dtype=torch.float64))
    return (summed / count).cpu()


def case_sequences(tokenizer: Any, cases: list[dict[str, Any]], continuations: Sequence[Sequence[str]] | Sequence[str],
                   limit: int | None) -> tuple[list[list[int]], list[int]]:
    """(token ids of each case's prompt and continuation, where the continuation starts). A case longer than `limit`
    positions keeps its last ones (the prompt's start goes first; logged once). A case's continuation may be several
    (a preference pair's chosen and rejected): one sequence each, in order."""
    seqs, starts, cut = [], [], 0
    for case, texts in zip(cases, continuations):
        replies, start = tokenize_replies(tokenizer, case["question"], [texts] if isinstance(texts, str) else list(texts))
        for ids in replies:
            begin = start
            if limit and len(ids) > limit:
                ids, begin, cut = ids[-limit:], max(1, start - (len(ids) - limit)), cut + 1
            seqs.append(ids)
            starts.append(begin)
    if cut:
        log.warning("%d of %d cases are longer than the model's %d positions: they keep their last tokens",
                    cut, len(cases), limit)
    return seqs, starts


def check_cells(restraints: Sequence[Restraint | None], dpo: Any, sft: Any) -> None:
    """Every restraint fits `dpo`; a revert reverts toward `sft` (the fingerprint its spec recorded, where it did)."""
    from rolemrc.core.modeling import fingerprints

    for r in {id(r): r for r in restraints if r is not None}.values():
        validate(r, dpo)
        recorded = r.reference.get("fingerprint") if r.kind == "revert" else None
        if recorded and not (recorded in fingerprints(sft, "directory").values()   # weights hashed only if needed
                             or recorded in fingerprints(sft, "weights").values()):
            raise InputError(f"restraint {r.name!r} reverts toward {r.reference.get('name')} ({recorded}), not the "
                             f"SFT model measured against ({model_name(sft)})")


def restrained(dpo: Any, r: Restraint, sft: Any) -> Any:
    """The context in which `dpo` runs as restrained by `r`: its runtime hooks, or a revert baked in memory toward
    `sft` (the SFT model it reverts toward) and undone on exit."""
    from rolemrc.intervene.bake import folded

    return applied(dpo, r, checked=True) if r.hooked else folded(dpo, r, sft)


def margin_grid(sft: Any, dpo: Any, tokenizer: Any, pairs: Sequence[dict[str, Any]], restraints: Sequence[Restraint | None],
                *, batch_size: int = 8, progress: bool = True) -> torch.Tensor:
    """float64 [cells, pairs]: DPO's implicit-reward margin of each cell (the DPO model under each restraint; None:
    the DPO model itself) on each preference pair (`prompt` turns, `chosen`, `rejected`): [log p(chosen) − log
    p_SFT(chosen)] − [log p(rejected) − log p_SFT(rejected)], each log p summed over the reply's tokens (beta 1),
    tokenised as trl's DPOTrainer does. The SFT model's margin is 0; the DPO model's is what DPO gained."""
    check_cells(restraints, dpo, sft)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    seqs, starts = case_sequences(tokenizer, [{"question": p["prompt"]} for p in pairs],
                                  [(p["chosen"], p["rejected"]) for p in pairs], context_window(dpo, tokenizer))
    device, sft_device = next(dpo.parameters()).device, next(sft.parameters()).device
    logp = torch.zeros(len(restraints), len(seqs), dtype=torch.float64)
    reference = torch.zeros(len(seqs), dtype=torch.float64)
    todo = list(batches(seqs, starts, batch_size, pad_id))
    with torch.inference_mode():
        for batch in tqdm(todo, desc="margins", unit="batch", disable=not progress):
            here, there = batch.to(device), batch.to(sft_device)
            reference[batch.index] = per_row_mean(-nll(there.targets(), logprobs(sft, there)), there, total=True)
            for k, r in enumerate(restraints):
                with contextlib.nullcontext() if r is None else restrained(dpo, r, sft):
                    logp[k, batch.index] = per_row_mean(-nll(here.targets(), logprobs(dpo, here)), here, total=True)
    ratio = logp - reference
    return ratio[:, 0::2] - ratio[:, 1::2]


def kl_grid(sft: Any, dpo: Any, tokenizer: Any, cases: Sequence[dict[str, Any]], continuations: Sequence[str],
            restraints: Sequence[Restraint | None], *, batch_size: int = 8, neutral: Sequence[str] = (),
            progress: bool = True) -> KLResult:
    """KL(cell ‖ SFT) per case for every cell (the DPO model under each restraint, hooked or, for a revert, baked in
    memory toward `sft`; None: the DPO model itself) and KL(DPO ‖ SFT), on each case's prompt (`question` turns)
    followed by its continuation, tokenised as trl's DPOTrainer does (`core.chat.tokenize_replies`); and each cell's NLL
    and KL to the DPO model on the `neutral` plain texts. One forward
    per batch per model and cell; nothing but per-case means is kept across batches."""
    if len(continuations) != len(cases):
        raise InputError(f"{len(continuations)} continuations for {len(cases)} cases")
    vocab = [m.get_output_embeddings().weight.shape[0] for m in (sft, dpo)]
    if vocab[0] != vocab[1]:
        raise InputError(f"the SFT and DPO models' vocabularies differ ({vocab[0]} and {vocab[1]} tokens)")
    check_cells(restraints, dpo, sft)
    cases = canonical_cases(cases)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    limit = context_window(dpo, tokenizer)
    seqs, starts = case_sequences(tokenizer, cases, continuations, limit)
    texts = [ids[:limit] for ids in tokenizer(list(neutral))["input_ids"]] if neutral else []
    if any(len(t) < 2 for t in texts):
        raise InputError("neutral texts need at least two tokens each")
    cells, device, sft_device = len(restraints), next(dpo.parameters()).device, next(sft.parameters()).device
    out = KLResult(torch.zeros(cells, len(cases), dtype=torch.float64), torch.zeros(len(cases), dtype=torch.float64),
                   torch.tensor([len(s) - max(1, b) for s, b in zip(seqs, starts)]),
                   [dimensions_for_task(c.get("task")) for c in cases],
                   torch.zeros(cells, len(texts), dtype=torch.float64), torch.zeros(len(texts), dtype=torch.float64),
                   torch.zeros(cells, len(texts), dtype=torch.float64))

    def scored(batch: Batch, measure: Callable[[torch.Tensor], torch.Tensor],
               to_dpo: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the DPO model's, every cell's) per-row means of `measure(log-probs)`; with `to_dpo` ([cells, rows] of
        this batch), each cell's mean KL to the DPO model written there too."""
        dpo_lp = logprobs(dpo, batch)
        dpo_value = per_row_mean(measure(dpo_lp), batch)
        values = []
        for k, r in enumerate(restraints):
            if r is None:
                values.append(dpo_value)
                continue
            with restrained(dpo, r, sft):
                lp = logprobs(dpo, batch)
            values.append(per_row_mean(measure(lp), batch))
            if to_dpo is not None:
                to_dpo[k] = per_row_mean(kl_to(dpo_lp, lp), batch)
        return dpo_value, torch.stack(values)

    case_batches = list(batches(seqs, starts, batch_size, pad_id))
    text_batches = list(batches(texts, [1] * len(texts), batch_size, pad_id))
    bar = tqdm(total=len(case_batches) + len(text_batches), desc="kl", unit="batch", disable=not progress)
    with torch.inference_mode():
        for batch in case_batches:
            sft_lp = partial(kl_to, logprobs(sft, batch.to(sft_device)).to(device))   # this batch's only
            out.dpo[batch.index], out.kl[:, batch.index] = scored(batch.to(device), sft_lp)
            del sft_lp
            bar.update()
        for batch in text_batches:
            here = batch.to(device)
            to_dpo = torch.zeros(cells, len(batch.index), dtype=torch.float64)
            out.neutral_dpo[batch.index], out.neutral[:, batch.index] = scored(here, partial(nll, here.targets()), to_dpo)
            out.neutral_kl[:, batch.index] = to_dpo
            bar.update()
    bar.close()
    return out
