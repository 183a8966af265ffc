"""Turning records into probe cases: prompt token ids and the dimensions each case counts in."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

import torch

from rolemrc.core.chat import render_chat
from rolemrc.core.records import prompt_turns
from rolemrc.core.taxonomy import DIMENSIONS, dimensions_for_task
from rolemrc.probe.errors import ProbeError
from rolemrc.probe.topcases import case_text

UNGROUPED = "all"


@dataclass
class Cases:
    """Tokenised prompts (unpadded), a [cases, dimensions] 0/1 membership matrix and, from `build_cases`,
    each case's identity hash (int64 [cases], `case_hash`)."""

    input_ids: list[list[int]]
    membership: torch.Tensor
    dimensions: list[str]
    truncated: int
    fingerprint: str
    hashes: torch.Tensor | None = None
    texts: list[dict[str, Any]] | None = None  # per case: id, dimensions, prompt text (topcases.case_text)

    def __len__(self) -> int:
        return len(self.input_ids)


def case_hash(record_id: Any, input_ids: list[int], dimensions: list[str]) -> int:
    """A case's identity as a signed 64-bit int: the record's `id` (None when it has none), its prompt
    tokens and its dimensions. Probe files keep these to refuse merging files that share a case."""
    digest = hashlib.sha256(repr((record_id, input_ids, dimensions)).encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def cases_fingerprint(hashes: torch.Tensor) -> str:
    """16 hex digits over the sorted case hashes: the same set of cases gives the same fingerprint in any
    order, so a merged probe file's equals that of one collection over all its cases."""
    return hashlib.sha256(hashes.sort().values.numpy().tobytes()).hexdigest()[:16]


def dimension_order(seen: set[str], by_field: bool) -> list[str]:
    """The probe's dimensions given those seen: with a dimension field, sorted with `all` last; else the
    five RoleMRC dimensions, empty ones included, then `all` if seen."""
    named = sorted(seen - {UNGROUPED}) if by_field else list(DIMENSIONS)
    return named + ([UNGROUPED] if UNGROUPED in seen else [])


def case_dimensions(record: dict[str, Any], dimension_field: str | None) -> list[str]:
    """Dimensions of one record: its `dimension_field` value(s) if given, else the task taxonomy."""
    if dimension_field:
        value = record.get(dimension_field)
        if value is None or value == "" or value == []:
            return []
        return [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return list(dimensions_for_task(record.get("task")))


def membership_matrix(per_case: list[list[str]], by_field: bool) -> tuple[list[str], torch.Tensor]:
    """(the dimensions in `dimension_order`, a [cases, dimensions] 0/1 matrix) from each case's dimensions."""
    dimensions = dimension_order({d for dims in per_case for d in dims}, by_field)
    index = {d: j for j, d in enumerate(dimensions)}
    membership = torch.zeros(len(per_case), len(dimensions))
    for i, dims in enumerate(per_case):
        membership[i, [index[d] for d in dims]] = 1.0
    return dimensions, membership


def prompt_cases(records: list[dict[str, Any]], source: str | os.PathLike | None = None) -> list[list[dict[str, str]]]:
    """Each record's prompt turns, checked (errors name `source`, the file they came from); cheap, so collect() runs
    it before loading a model."""
    if not records:
        raise ProbeError("no records to probe")
    prefix = f"{source}: " if source else ""
    return [prompt_turns(record, where=f"{prefix}record {i} (id {record.get('id', '?')})")
            for i, record in enumerate(records)]


def build_cases(records: list[dict[str, Any]], tokenizer: Any, *, dimension_field: str | None = None,
                generation_prompt: bool = True, prepend_bos: bool = False, max_length: int | None = None) -> Cases:
    """Render each record's prompt turns with the chat template and tokenise them (`prepend_bos`: then put the
    tokenizer's BOS token first, as TransformerLens does to a string it is given).

    Records with no dimension count under `all`. Prompts longer than `max_length` keep their last
    `max_length` tokens (the position the probe reads) and are counted as truncated.
    """
    turns = prompt_cases(records)
    texts = [render_chat(tokenizer, t, add_generation_prompt=generation_prompt) for t in turns]
    per_case = [case_dimensions(record, dimension_field) or [UNGROUPED] for record in records]
    dimensions, membership = membership_matrix(per_case, bool(dimension_field))
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    if prepend_bos:
        if tokenizer.bos_token_id is None:
            raise ProbeError("prepend_bos: the tokenizer has no BOS token")
        ids = [[tokenizer.bos_token_id, *x] for x in ids]
    truncated = 0
    if max_length:
        truncated = sum(len(x) > max_length for x in ids)
        ids = [x[-max_length:] for x in ids]
    hashes = torch.tensor([case_hash(record.get("id"), x, dims) for record, x, dims in zip(records, ids, per_case)],
                          dtype=torch.int64)
    shown = [{"id": record.get("id"), "dimensions": dims, "text": case_text(t)}
             for record, dims, t in zip(records, per_case, turns)]
    return Cases(ids, membership, dimensions, truncated, cases_fingerprint(hashes), hashes, shown)


def batch_indices(cases: Cases, batch_size: int, rank: int = 0, world: int = 1) -> list[list[int]]:
    """Case indices per batch, longest prompts first; of `world` processes, rank `rank` takes every
    world-th batch from its rank on, so each batch is the one a single process would run."""
    if batch_size < 1:
        raise ProbeError(f"batch size must be >= 1, got {batch_size}")
    order = sorted(range(len(cases)), key=lambda i: -len(cases.input_ids[i]))
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)][rank::world]


def batches(cases: Cases, batch_size: int, pad_id: int, rank: int = 0, world: int = 1):
    """Yield (indices, input_ids, attention_mask), right-padded, for the batches of `batch_indices`.

    Right padding keeps every real token at its unpadded position, so with causal attention the real
    tokens' activations do not depend on the batch they share.
    """
    for idx in batch_indices(cases, batch_size, rank, world):
        yield torch.tensor(idx), *pad_right([cases.input_ids[i] for i in idx], pad_id)


def pad_right(rows: list[list[int]], pad_id: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [rows, length] of token-id rows padded on the right to `length` (default: the
    longest row)."""
    length = length or max(map(len, rows))
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for r, row in enumerate(rows):
        input_ids[r, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[r, :len(row)] = 1
    return input_ids, mask
