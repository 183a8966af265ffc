"""Attribution patching over preference pairs (`rolemrc probe attribute`): which units carry the DPO model's margin.

For each unit u of each layer at a hook point (any row of `HOOK_POINTS`),

    score(u) = sum over pairs, over every position of the chosen and of the rejected sequence (prompt and reply,
               not padding), of dMargin/da(u, pos) * (a_dpo - a_sft)(u, pos)

with margin = [log p_dpo(chosen) - log p_sft(chosen)] - [log p_dpo(rejected) - log p_sft(rejected)], each log p the
sum over the reply's tokens (tokenised as trl's DPOTrainer does, end-of-turn tokens included:
`core.chat.tokenize_replies`): DPO's implicit-reward margin. The gradient is taken through the DPO model's activations
at the hook (parameters frozen; the SFT terms are constants) and a_sft are the SFT model's activations on the same
tokens. A score is the first-order estimate of the margin that the unit's SFT -> DPO change produces: positive, the
change favours the chosen reply; a unit whose activations do not change scores exactly 0.

All positions, not the reply's alone (metadata `reply_tokens`: the reply's tokens make the margin; every position is
scored): a restraint scales a unit at every position, and the prompt's activations reach the reply's log-probs
through attention. The prompt is shared by both sequences, so its positions count with the difference of the two
gradients; a reply-only sum would drop the last prompt token, which predicts the reply's first token.

Attribution file (docs/ARCHITECTURE.md "Attribution file"): safetensors with `attribution.<dim>` (int64
[layers, width]: the sum over the dimension's pairs of each pair's score rounded to SCORE_UNIT, so sums are exact in
any order: shards, processes, merges), `pairs.<dim>` (int64 scalar), `case_hashes` (int64 [pairs], sorted) and with
resamples R > 0 `resampled.attribution.<dim>` (int64 [R, layers, width]) and `resampled.pairs.<dim>` (int64 [R]): the
Poisson bootstrap replicates of the pairs, each pair's score summed with its integer weight (probe/resample.py); metadata
`kind: attribution`, hook, width, layers, dimensions, models (sft and dpo), reply_tokens, score_bits, max_length,
dimension_field, truncated, limit, resamples, data and pairs fingerprints, batch_size (pairs per batch; `auto`: probe/memory.py),
peak_memory_gib (torch.cuda.max_memory_allocated on the DPO model's GPU; empty on the CPU), toolkit_version.

A pair's score does not depend on the pairs it is batched with: a batch holds pairs of one length bucket
(`bucket_length`) padded to that bucket's length, and on the CPU a padded row's activations depend on its padded
length only, not on the other rows; so any split of the pairs adds up to one pass over all of them, bit for bit.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from rolemrc.core.artifacts import JSONL_INPUT, check_format, expect, stamp
from rolemrc.core.chat import tokenize_replies
from rolemrc.core.hooks import WIDTHS, Site, check_point, hook_point, num_layers, site, width
from rolemrc.core.io import file_fingerprint, iter_jsonl
from rolemrc.core.modeling import check_model_dir
from rolemrc.core.placement import DeviceMap, Dtype, check_dtype, check_placement
from rolemrc.core.records import first_cases, normalize_record, reply_text
from rolemrc.core.version import __version__
from rolemrc.probe.cases import UNGROUPED, case_dimensions, case_hash, cases_fingerprint, membership_matrix, pad_right
from rolemrc.probe.collect import check_same_shape, check_same_tokenizer, load_probed, resolve_named, shared_window
from rolemrc.probe.counts import CASE_HASHES, read_tensors, write_tensors
from rolemrc.probe.distributed import all_reduce_min, all_reduce_sum, process_group, shard_from_env
from rolemrc.probe.errors import ProbeError
from rolemrc.probe.memory import auto_batch_size
from rolemrc.probe.options import DEFAULT_RESAMPLES
from rolemrc.probe.paired import NAME_KEYS
from rolemrc.probe.resample import (
    check_resamples,
    replicate_tensors,
    resample_count,
    resample_weights,
    stack_replicates,
    with_replicates,
)

KIND = "attribution"  # metadata `kind` of an attribution file
ROLES = ("sft", "dpo")
REPLY_TOKENS = "margin; scores over all positions"  # metadata `reply_tokens` (module docstring)
SCORE_BITS = 32
SCORE_UNIT = 2.0 ** -SCORE_BITS  # each pair's per-unit score is rounded to this before it is summed
MAX_SCORE = 2.0 ** (62 - SCORE_BITS)  # a pair's |score| must stay below this to fit int64 with room to sum
SAME_TOKENS = "attribution compares both models' activations on the same tokens"
# Metadata that must agree for attribution files to add up (and `Attribution.model_identity`).
ATTRIBUTION_KEYS = ("kind", "hook", "width", "layers", "reply_tokens", "score_bits", "max_length", "dimension_field",
                    "limit", "resamples")


@dataclass
class AttributeConfig:
    """How to attribute (module docstring)."""

    hook: str = "mlp.act"  # a name in HOOK_POINTS
    batch_size: int | Literal["auto"] = "auto"  # preference pairs per batch (twice as many sequences); probe/memory.py
    dimension_field: str | None = None
    max_length: int | None = None  # default: the models' context window; longer pairs keep their prompt's last tokens
    limit: int | None = None  # use only the first `limit` pairs of the data
    dtype: Dtype = "auto"  # auto: the checkpoint's own
    device: str = "auto"
    device_map: DeviceMap | None = None  # place each model loaded from a directory over this process's devices
    progress: bool = True
    resamples: int = DEFAULT_RESAMPLES  # Poisson bootstrap replicates of the pairs scored alongside (0: off)

    def __post_init__(self) -> None:
        check_point(self.hook)
        check_resamples(self.resamples)
        check_dtype(self.dtype)
        check_placement(self.device, self.device_map)
        if isinstance(self.batch_size, str) and self.batch_size.isdigit():
            self.batch_size = int(self.batch_size)
        if self.batch_size != "auto" and not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise ProbeError(f"batch size must be auto or a whole number >= 1, got {self.batch_size!r}")
        if self.max_length is not None and self.max_length < 2:
            raise ProbeError(f"max length must be >= 2 tokens, got {self.max_length}")


@dataclass
class Pairs:
    """Tokenised preference pairs: each one's chosen and rejected sequence (prompt + reply token ids), the index of
    the replies' first token, a [pairs, dimensions] 0/1 membership and identity hashes (int64 [pairs])."""

    chosen: list[list[int]]
    rejected: list[list[int]]
    starts: list[int]
    membership: torch.Tensor
    dimensions: list[str]
    hashes: torch.Tensor
    truncated: int

    def __len__(self) -> int:
        return len(self.chosen)


@dataclass
class Attribution:
    """Per dimension, the summed scores (int64 [layers, width] in SCORE_UNITs) and the pairs they sum over;
    `resamples`: the Poisson bootstrap replicates of the pairs (probe/resample.py), each an Attribution."""

    sums: dict[str, torch.Tensor]
    pairs: dict[str, int]
    meta: dict[str, str]
    case_hashes: torch.Tensor  # int64 [pairs], sorted
    resamples: list[Attribution] = field(default_factory=list)

    @property
    def dimensions(self) -> list[str]:
        return list(self.sums)

    @property
    def empty_dimensions(self) -> list[str]:
        return [d for d in self.sums if self.pairs[d] == 0]

    def mean(self, dimension: str) -> torch.Tensor:
        """float64 [layers, width]: the mean score per pair of one dimension; raises for an empty dimension."""
        if dimension not in self.sums:
            raise ProbeError(f"no dimension {dimension!r}; have {self.dimensions}")
        if self.pairs[dimension] == 0:
            raise ProbeError(f"dimension {dimension!r} has no pairs: its mean score is undefined")
        return self.sums[dimension].double() * SCORE_UNIT / self.pairs[dimension]

    @property
    def scores(self) -> dict[str, torch.Tensor]:
        """The mean score tensors of every dimension with pairs."""
        return {d: self.mean(d) for d in self.sums if self.pairs[d]}

    @property
    def model_identity(self) -> dict[str, dict[str, str]]:
        """Each model's metadata but its name and directory (files computed anywhere may name the same model
        differently)."""
        return {role: {k: v for k, v in m.items() if k not in NAME_KEYS} for role, m in json.loads(self.meta["models"]).items()}

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for d in self.dimensions:
            out[f"attribution.{d}"] = self.sums[d].cpu().contiguous()
            out[f"pairs.{d}"] = torch.tensor(self.pairs[d], dtype=torch.int64)
        return {**out, CASE_HASHES: self.case_hashes, **stack_replicates([rep.tensors() for rep in self.resamples])}

    def save(self, path: str | os.PathLike) -> Path:
        return write_tensors(path, self.tensors(), {**self.meta, "dimensions": json.dumps(self.dimensions)})


def is_attribution_file(path: str | os.PathLike) -> bool:
    """Whether `path` is a readable safetensors file whose metadata says `kind: attribution` (metadata alone is read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            return (fh.metadata() or {}).get("kind") == KIND
    except Exception:  # missing or unreadable: not one; the loader that reads it names the problem
        return False


def load_attribution(path: str | os.PathLike) -> Attribution:
    """An attribution file (`rolemrc probe attribute`); its `scores` are the per-dimension mean score tensors."""
    expect(path, "attribution", "expected an attribution file (from `rolemrc probe attribute`)")
    meta, tensors = read_tensors(path, "attribution file", missing="no such attribution file")
    check_format(path, meta, KIND)
    return attribution_from_tensors(meta, tensors)


def attribution_from_tensors(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> Attribution:
    """An Attribution from an attribution file's metadata and tensors, its replicates included."""
    resamples = [attribution_from_tensors(meta, replicate_tensors(tensors, r)) for r in range(resample_count(tensors))]
    meta = dict(meta)
    dims = json.loads(meta.pop("dimensions"))
    return Attribution({d: tensors[f"attribution.{d}"] for d in dims}, {d: int(tensors[f"pairs.{d}"]) for d in dims},
                       meta, tensors[CASE_HASHES], resamples)


def read_pairs(data: Any) -> tuple[list[dict[str, Any]], str]:
    """(canonical preference pairs: `prompt` turns and `chosen`/`rejected` texts, the file's fingerprint or '' for a
    list of records) of a JSONL path or a list of records. A record without both replies is a ProbeError naming it;
    cheap, so run before any model loads."""
    if isinstance(data, (str, os.PathLike)):
        expect(data, JSONL_INPUT, "expected preference pairs (JSONL with prompt, chosen and rejected)")
        numbered = [(lineno, f"{data}:{lineno}", record) for lineno, record in iter_jsonl(data)]
        fingerprint = file_fingerprint(data)
    else:
        numbered = [(None, f"record {i} (id {r.get('id', '?')})", r) for i, r in enumerate(data)]
        fingerprint = ""
    if not numbered:
        raise ProbeError(f"{data if fingerprint else 'data'}: no preference pairs")
    return [_pair(record, lineno, where) for lineno, where, record in numbered], fingerprint


def _pair(record: dict[str, Any], lineno: int | None, where: str) -> dict[str, Any]:
    pair, _ = normalize_record(record, lineno, "pair", where=where)
    pair["rejected"] = reply_text(record.get("rejected"), "rejected", where=where)
    for side in ("chosen", "rejected"):
        if not isinstance(pair[side], str) or not pair[side].strip():
            raise ProbeError(f"{where}: a preference pair needs a non-empty '{side}' reply")
    return pair


def build_pairs(records: list[dict[str, Any]], tokenizer: Any, *, dimension_field: str | None = None,
                max_length: int | None = None) -> Pairs:
    """Tokenise each pair's chosen and rejected conversation with the chat template (`tokenize_replies`). A pair
    whose longer sequence exceeds `max_length` tokens counts as truncated and keeps, as `probe collect` does, its
    prompt's last tokens (those nearest the replies; the same ones in both sequences) and its replies whole; a reply
    that alone leaves no room keeps the prompt's last token and the reply's first tokens. Each pair counts in its
    dimensions, as a probe case does."""
    chosen, rejected, starts, truncated = [], [], [], 0
    for record in records:
        (c, r), start = tokenize_replies(tokenizer, record["prompt"], [record["chosen"], record["rejected"]])
        if max_length and max(len(c), len(r)) > max_length:
            kept = min(start, max(1, max_length - max(len(c), len(r)) + start))   # the prompt's last tokens
            c, r = (seq[start - kept:start - kept + max_length] for seq in (c, r))
            start, truncated = kept, truncated + 1
        chosen.append(c)
        rejected.append(r)
        starts.append(start)
    per_pair = [case_dimensions(record, dimension_field) or [UNGROUPED] for record in records]
    dimensions, membership = membership_matrix(per_pair, bool(dimension_field))
    hashes = torch.tensor([case_hash(record.get("id"), [*c, -1, *r], dims)  # -1: no token, between the sequences
                           for record, c, r, dims in zip(records, chosen, rejected, per_pair)], dtype=torch.int64)
    return Pairs(chosen, rejected, starts, membership, dimensions, hashes, truncated)


def bucket_length(n: int, cap: int | None) -> int:
    """The padded length of a sequence of n tokens: n rounded up to a multiple of a quarter of its power of two, at
    least 8 (under 25% padding from 32 tokens on), capped at `cap`."""
    step = max(8, 1 << max(0, n.bit_length() - 3))
    length = -(-n // step) * step
    return min(length, cap) if cap else length


def pair_batches(pairs: Pairs, batch_size: int, cap: int | None, rank: int = 0,
                 world: int = 1) -> list[tuple[list[int], int]]:
    """(pair indices, padded length) per batch: pairs grouped by the bucket of their longer sequence, longest first,
    in data order within a bucket; of `world` processes, rank `rank` takes every world-th batch from its rank on."""
    lengths = [bucket_length(max(len(c), len(r)), cap) for c, r in zip(pairs.chosen, pairs.rejected)]
    order = sorted(range(len(pairs)), key=lambda i: -lengths[i])
    batches = []
    for length, group in itertools.groupby(order, key=lengths.__getitem__):
        group = list(group)
        batches += [(group[s:s + batch_size], length) for s in range(0, len(group), batch_size)]
    return batches[rank::world]


def reply_logprobs(model: Any, hidden: torch.Tensor, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[rows]: each row's sum of log p(token) over the tokens `targets` marks, each predicted from the final hidden
    state one position before it through the model's output embeddings (only those positions reach the LM head)."""
    rows, cols = targets.nonzero(as_tuple=True)
    logits = model.get_output_embeddings()(hidden[rows, cols - 1]).float()
    token_logp = logits.log_softmax(-1).gather(1, input_ids[rows, cols].unsqueeze(1)).squeeze(1)
    return token_logp.new_zeros(len(input_ids)).index_add(0, rows, token_logp)


def margin_gradients(model: Any, sites: list[Site], input_ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor,
                     sign: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(activations, d objective / d activations) per layer at the sites, objective = sum over rows of sign * the
    reply's log-prob. A site whose tensor does not require grad (the first, with frozen parameters) is made a leaf
    that does, so every later site is part of the graph."""
    acts: list[torch.Tensor | None] = [None] * len(sites)

    def keep(layer: int, tensor: torch.Tensor) -> torch.Tensor:
        acts[layer] = tensor if tensor.requires_grad else tensor.detach().requires_grad_()
        return acts[layer]

    handles = [s.rewrite(lambda t, i=s.layer: keep(i, t)) for s in sites]
    try:
        with torch.enable_grad():
            out = model.base_model(input_ids=input_ids, attention_mask=mask, use_cache=False)
            logp = reply_logprobs(model, out[0], input_ids, targets)
            objective = (logp * sign.to(logp.device)).sum()
            grads = torch.autograd.grad(objective, acts, materialize_grads=True)
    finally:
        for h in handles:
            h.remove()
    return [a.detach() for a in acts], list(grads)


def unit_scores(model: Any, sites: list[Site], input_ids: torch.Tensor, mask: torch.Tensor, acts: list[torch.Tensor],
                grads: list[torch.Tensor], out: torch.Tensor) -> None:
    """out[row, layer] (float64 [rows, layers, width]) = sum over the row's real positions of grad * (act - the
    reference model's activation there), the reference's activations taken layer by layer as it runs."""
    weight = mask.to(torch.float64)

    def score(layer: int, reference: torch.Tensor) -> None:
        change = acts[layer].double() - reference.to(acts[layer].device).double()
        terms = grads[layer].double() * change * weight.to(change.device).unsqueeze(-1)
        out[:, layer] = terms.sum(1).to(out.device)

    handles = [s.capture(lambda t, i=s.layer: score(i, t)) for s in sites]
    try:
        with torch.inference_mode():
            model.base_model(input_ids=input_ids, attention_mask=mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()


def in_score_units(per_pair: torch.Tensor, membership: torch.Tensor) -> torch.Tensor:
    """int64 [dims, layers, width]: per dimension, the sum over its pairs of each pair's scores [pairs, layers, width]
    rounded to SCORE_UNIT, each times the pair's integer membership weight [pairs, dims] (exact in any order)."""
    if not torch.isfinite(per_pair).all() or per_pair.abs().max() >= MAX_SCORE:
        raise ProbeError(f"a pair's attribution is not finite or exceeds {MAX_SCORE:g} (largest |score| "
                         f"{per_pair.abs().max().item():g}); attribute in float32 (--dtype float32)")
    units = (per_pair / SCORE_UNIT).round().long()   # int64 (no integer matmul on GPUs): one row at a time
    return torch.stack([(units * weight[:, None, None]).sum(0) for weight in membership.long().T.to(units.device)])


@contextmanager
def frozen(*models: Any) -> Iterator[None]:
    """The models' parameters with requires_grad off for the block (restored after): gradients reach activations only."""
    flags = [(p, p.requires_grad) for m in models for p in m.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def batch_size(dpo: Any, pairs: Pairs, config: AttributeConfig, cap: int | None, shard: Any) -> int:
    """Pairs per batch: config's, or for auto the cost model's at the longest padded length (the same on every rank:
    the smallest of theirs, so all split the pairs alike)."""
    if config.batch_size != "auto":
        return config.batch_size
    longest = max(bucket_length(max(len(c), len(r)), cap) for c, r in zip(pairs.chosen, pairs.rejected))
    device = next(dpo.parameters()).device
    return all_reduce_min(auto_batch_size(dpo, config.hook, longest), device, shard)


def attribute_pairs(sft: Any, dpo: Any, tokenizer: Any, pairs: Pairs, config: AttributeConfig,
                    cap: int | None) -> tuple[torch.Tensor, int]:
    """The hot loop: (int64 [dims x (1 + resamples), layers, width] sums of the pairs' scores in SCORE_UNITs, on the
    DPO model's device, the full sample's dimensions then each replicate's (`resample.with_replicates`); the pairs per
    batch). Each batch: the chosen then the rejected sequences through the DPO model
    (activations and the margin's gradient), then through the SFT model (its activations, scored at once).
    Launched as several processes, each scores every world-th batch and the sums are added over the ranks."""
    layers, units = num_layers(dpo), width(dpo, config.hook)
    device, sft_device = next(dpo.parameters()).device, next(sft.parameters()).device
    rows = len(pairs.dimensions) * (1 + config.resamples)   # the full sample's dimensions, then each replicate's
    sums = torch.zeros(rows, layers, units, dtype=torch.int64, device=device)
    weights = resample_weights(pairs.hashes, config.resamples)
    dpo_sites, sft_sites = ([site(m, config.hook, i) for i in range(layers)] for m in (dpo, sft))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with process_group(device) as shard, frozen(sft, dpo):
        size = batch_size(dpo, pairs, config, cap, shard)
        batches = pair_batches(pairs, size, cap, shard.rank, shard.world)
        bar = tqdm(total=sum(len(idx) for idx, _ in batches), desc=f"attribute {config.hook}", unit="pair",
                   disable=not (config.progress and shard.main))
        for idx, length in batches:
            n = len(idx)
            input_ids, mask = pad_right([pairs.chosen[i] for i in idx] + [pairs.rejected[i] for i in idx], pad_id, length)
            starts = torch.tensor([pairs.starts[i] for i in idx] * 2).clamp(min=1)  # a first token has no prediction
            targets = mask.bool() & (torch.arange(length) >= starts[:, None])
            sign = torch.cat([torch.ones(n), -torch.ones(n)])
            input_ids, mask = input_ids.to(device), mask.to(device)
            acts, grads = margin_gradients(dpo, dpo_sites, input_ids, mask, targets.to(device), sign)
            scores = torch.zeros(2 * n, layers, units, dtype=torch.float64, device=device)
            unit_scores(sft, sft_sites, input_ids.to(sft_device), mask.to(sft_device), acts, grads, scores)
            sums += in_score_units(scores[:n] + scores[n:], with_replicates(pairs.membership[idx], weights[:, idx]))
            bar.update(n)
        bar.close()
        all_reduce_sum([sums], shard)
    return sums, size


def config_shape(path: str | os.PathLike, hook: str) -> dict[str, Any]:
    """A model directory's architecture, vocabulary size, layers and width at `hook`, from its config alone."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(check_model_dir(path), local_files_only=True)
    return {"model type": config.model_type, "vocabulary": config.vocab_size, "layers": config.num_hidden_layers,
            "width": WIDTHS[hook_point(hook).width](config)}


def check_same_configs(sft: str | os.PathLike, dpo: str | os.PathLike, hook: str) -> None:
    """Refuse two model directories whose configs differ in architecture, vocabulary, layers or width at `hook`
    (before either model loads)."""
    shapes = [config_shape(path, hook) for path in (sft, dpo)]
    differ = [f"{key}: {shapes[0][key]} vs {shapes[1][key]}" for key in shapes[0] if shapes[0][key] != shapes[1][key]]
    if differ:
        raise ProbeError(f"models {sft} and {dpo} differ ({'; '.join(differ)}); {SAME_TOKENS}, unit by unit")


def attribute(models: Sequence[Any], data: Any, config: AttributeConfig | None = None, *,
              tokenizers: Sequence[Any] = (None, None), **overrides: Any) -> Attribution:
    """Attribution patching of a DPO model against its SFT model over preference pairs.

    models: exactly two, the reference (SFT) first, then the model tuned from it (DPO), as `collect_paired` takes
    them: model names (local HF directories, pulled models' names, hub ids `org/name[@revision]`), or loaded causal
    LMs (then pass their `tokenizers`).
    data: a JSONL path or a list of preference-pair records (`prompt`, `chosen`, `rejected`, `task`).
    Keyword overrides replace fields of `config`. Inputs are checked before a model loads.
    """
    if len(models) != 2:
        raise ProbeError(f"attribution compares exactly two models, the reference (SFT) first and the model tuned from "
                         f"it (DPO) second; got {len(models)}")
    sft, dpo = models
    config = AttributeConfig(**{**asdict(config or AttributeConfig()), **overrides})
    sft, dpo = resolve_named(sft), resolve_named(dpo)
    records, data_fingerprint = read_pairs(data)
    records = first_cases(records, config.limit)
    if isinstance(sft, tuple) and isinstance(dpo, tuple):
        check_same_configs(sft[1], dpo[1], config.hook)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    loaded = [load_probed(m, t, config) for m, t in zip((sft, dpo), tokenizers, strict=True)]
    (sft, tokenizer, sft_meta), (dpo, _, dpo_meta) = loaded
    names = [sft_meta["model"], dpo_meta["model"]]
    check_same_tokenizer([t for _, t, _ in loaded], names, why=SAME_TOKENS)
    check_same_shape([sft, dpo], names, config.hook)
    cap = shared_window([sft, dpo], tokenizer, config.max_length)
    pairs = build_pairs(records, tokenizer, dimension_field=config.dimension_field, max_length=cap)
    sums, size = attribute_pairs(sft, dpo, tokenizer, pairs, config, cap)
    device = next(dpo.parameters()).device
    peak = f"{torch.cuda.max_memory_allocated(device) / 2 ** 30:.2f}" if device.type == "cuda" else ""
    fingerprint = cases_fingerprint(pairs.hashes)
    meta = {**stamp(KIND), "hook": config.hook, "width": str(sums.shape[2]), "layers": str(sums.shape[1]),
            "models": json.dumps(dict(zip(ROLES, (sft_meta, dpo_meta)))), "reply_tokens": REPLY_TOKENS,
            "score_bits": str(SCORE_BITS), "max_length": str(cap), "dimension_field": config.dimension_field or "",
            "truncated": str(pairs.truncated), "limit": str(config.limit or ""),
            "data_fingerprint": data_fingerprint or fingerprint,
            "pairs_fingerprint": fingerprint, "batch_size": str(size), "peak_memory_gib": peak,
            "resamples": str(config.resamples), "toolkit_version": __version__}
    counts = with_replicates(pairs.membership, resample_weights(pairs.hashes, config.resamples)).sum(0).round().long()
    dims, hashes = pairs.dimensions, pairs.hashes.sort().values

    def block(b: int) -> Attribution:   # the full sample (0) or replicate b - 1
        rows = list(enumerate(dims, start=b * len(dims)))
        return Attribution({d: sums[j].cpu() for j, d in rows}, {d: int(counts[j]) for j, d in rows}, meta, hashes)

    return replace(block(0), resamples=[block(1 + r) for r in range(config.resamples)])


def attribute_to_file(models: Sequence[Any], data: Any, out: str | os.PathLike, config: AttributeConfig | None = None,
                      **overrides: Any) -> Path:
    """attribute() and save the attribution file; launched as several processes, only rank 0 writes."""
    result = attribute(models, data, config, **overrides)
    return result.save(out) if shard_from_env().main else Path(out)
