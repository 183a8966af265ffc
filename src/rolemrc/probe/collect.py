"""`collect`: stream a model over probe cases and count top-k units per layer and dimension."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, get_args

import torch
from tqdm.auto import tqdm

from rolemrc.core.extras import require
from rolemrc.core.hooks import check_point, num_layers, width
from rolemrc.core.io import file_fingerprint, read_input_jsonl
from rolemrc.core.modeling import (
    context_window,
    dir_fingerprint,
    is_path,
    load_model,
    loaded_model,
    model_fingerprint,
    model_name,
    model_source,
    resolve_model,
    tokenizer_of,
)
from rolemrc.core.placement import DeviceMap, Dtype, check_dtype, check_placement
from rolemrc.core.records import as_records, first_cases
from rolemrc.core.version import __version__
from rolemrc.probe.backends import make_backend
from rolemrc.probe.cases import Cases, batch_indices, batches, build_cases, prompt_cases
from rolemrc.probe.counts import ProbeCounts, TopKCounter, check_top_fraction, top_k_size
from rolemrc.probe.distributed import all_gather, all_reduce_sum, process_group, rank_gpus, shard_from_env
from rolemrc.probe.errors import ProbeError, check_choice
from rolemrc.probe.options import DEFAULT_RESAMPLES, Backend, Rank, Rounding, Tokens
from rolemrc.probe.paired import PairedCounter, PairedCounts
from rolemrc.probe.presets import PRESETS
from rolemrc.probe.resample import check_resamples, resample_weights, with_replicates
from rolemrc.probe.topcases import TopCases, check_top_cases, sorted_positions


@dataclass
class CollectConfig:
    """How to count (docs/ARCHITECTURE.md "Probe file"); rolemrc's defaults, or a named preset's settings
    (`from_preset`, probe/presets.py; docs/probe.md compares them)."""

    hook: str = "mlp.act"  # a name in HOOK_POINTS
    top_fraction: float = 0.2
    top_rounding: Rounding = "up"  # top_fraction * width to a unit count: up, or down as the RoleMRC code does
    tokens: Tokens = "last"  # "last" prompt token, or "all" prompt tokens (each one observation)
    rank: Rank = "signed"  # or "abs"
    batch_size: int = 16
    top_cases: int = 5  # each unit's most activating cases kept per model (0: off; probe/topcases.py)
    backend: Backend = "torch"
    dimension_field: str | None = None
    generation_prompt: bool = True
    prepend_bos: bool = False  # put the tokenizer's BOS token before the rendered prompt (TransformerLens does)
    max_length: int | None = None  # default: the model's context window; longer prompts keep their last tokens
    limit: int | None = None  # use only the first `limit` cases of the data
    dtype: Dtype = "auto"  # auto: the checkpoint's own
    device: str = "auto"
    device_map: DeviceMap | None = None  # place a model loaded from a directory over this process's devices
    progress: bool = True
    preset: str = ""  # the preset these settings started from (set by `from_preset`)
    resamples: int = DEFAULT_RESAMPLES  # Poisson bootstrap replicates counted alongside (0: off; probe/resample.py)

    def __post_init__(self) -> None:
        check_point(self.hook)
        check_top_fraction(self.top_fraction)
        check_choice("top rounding", self.top_rounding, get_args(Rounding))
        if self.preset:
            PRESETS.check([self.preset])
        check_resamples(self.resamples)
        check_top_cases(self.top_cases)
        check_choice("token policy", self.tokens, get_args(Tokens))
        check_choice("rank", self.rank, get_args(Rank))
        check_choice("backend", self.backend, get_args(Backend))
        if self.backend != "torch":
            require("backends", what=f"the {self.backend} probe backend")
        check_dtype(self.dtype)
        check_placement(self.device, self.device_map)

    @classmethod
    def from_preset(cls, preset: str, **overrides: Any) -> CollectConfig:
        """The settings of the preset named `preset` (probe/presets.py), `overrides` on top."""
        return cls(**{**PRESETS.get(preset).settings, **overrides, "preset": preset})

    def preset_overrides(self) -> list[str]:
        """The fields of this config that differ from its preset's settings."""
        settings = PRESETS.get(self.preset).settings if self.preset else {}
        return [key for key, value in settings.items() if getattr(self, key) != value]


def collect(model: Any, data: Any, config: CollectConfig | None = None, *, tokenizer: Any = None,
            **overrides: Any) -> ProbeCounts:
    """Count how often each unit is in the top `top_fraction` per layer and dimension.

    model: a model name (a local HF directory, a pulled model's name, or a hub id `org/name[@revision]`) or a loaded
    causal LM (with `tokenizer`, or the one in its directory).
    data: a JSONL path, or a list of records (test, pair or SFT format), plain prompt strings or chat turn lists.
    Keyword overrides replace fields of `config`; `preset="rolemrc-code"` without a config starts from that preset.
    """
    config = _config(config, overrides)
    model = resolve_named(model)
    data, data_fingerprint = _read(data, config.limit)
    model, tokenizer, model_meta = load_probed(model, tokenizer, config)
    cases, meta = _cases(data, data_fingerprint, [model], tokenizer, config)
    counter = count_cases(model, tokenizer, cases, config)
    meta = {**meta, **model_meta, **_shape_meta(counter)}
    return replace(_counts(counter, cases, meta), resamples=[_counts(counter, cases, meta, 1 + r)
                                                             for r in range(config.resamples)])


def collect_paired(models: Sequence[Any], data: Any, config: CollectConfig | None = None, *,
                   tokenizers: Sequence[Any] | None = None, **overrides: Any) -> PairedCounts:
    """Count two or more models over the same cases in one pass (each batch runs through every model),
    keeping per pair of models the per-unit paired statistics (probe/paired.py). The models must share
    a tokenizer: the cases are tokenised once. Arguments as for `collect` (a tokenizer per loaded model)."""
    if len(models) < 2:
        raise ProbeError(f"paired collection needs two or more models, got {len(models)}")
    config = _config(config, overrides)
    models = [resolve_named(m) for m in models]
    data, data_fingerprint = _read(data, config.limit)
    tokenizers = list(tokenizers) if tokenizers is not None else [None] * len(models)
    loaded = [load_probed(m, t, config) for m, t in zip(models, tokenizers, strict=True)]
    names = [meta["model"] for _, _, meta in loaded]
    check_same_tokenizer([t for _, t, _ in loaded], names)
    check_same_shape([m for m, _, _ in loaded], names, config.hook)
    models, tokenizer = [m for m, _, _ in loaded], loaded[0][1]
    cases, meta = _cases(data, data_fingerprint, models, tokenizer, config)
    paired = count_paired(models, tokenizer, cases, config)
    meta = {**meta, **_shape_meta(paired.counters[0])}

    def block(b: int) -> PairedCounts:   # the full sample (0) or replicate b - 1
        counts = [_counts(counter, cases, {**meta, **model_meta}, b)
                  for counter, (_, _, model_meta) in zip(paired.counters, loaded)]
        return PairedCounts(counts, paired.tensors(cases.dimensions, b), meta)

    return replace(block(0), resamples=[block(1 + r) for r in range(config.resamples)])


PAIRED_TOKENS = "paired probing tokenises the cases once, so probe them separately and diff unpaired"


def check_same_tokenizer(tokenizers: list[Any], names: list[str], why: str = PAIRED_TOKENS) -> None:
    """Refuse models whose tokenizers differ (vocabulary, special tokens or chat template); `why` ends the message."""
    def signature(tok: Any) -> dict[str, Any]:
        return {"vocabulary": tok.get_vocab(), "chat template": getattr(tok, "chat_template", None),
                "special tokens": (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)}

    first = signature(tokenizers[0])
    for name, tok in zip(names[1:], tokenizers[1:]):
        other = signature(tok)
        differ = [key for key in first if other[key] != first[key]]
        if differ:
            sizes = f": {len(first['vocabulary'])} vs {len(other['vocabulary'])} tokens" if "vocabulary" in differ else ""
            raise ProbeError(f"models {names[0]} and {name} do not share a tokenizer ({', '.join(differ)} differ{sizes}); {why}")


def check_same_shape(models: list[Any], names: list[str], hook: str) -> None:
    """Refuse models with different layer counts or widths at the hook point."""
    shapes = [(num_layers(m), width(m, hook)) for m in models]
    for name, shape in zip(names[1:], shapes[1:]):
        if shape != shapes[0]:
            raise ProbeError(f"models {names[0]} and {name} differ at {hook}: (layers, width) {shapes[0]} vs {shape}")


def _config(config: CollectConfig | None, overrides: dict[str, Any]) -> CollectConfig:
    """`config` with `overrides` on top; without a config, the defaults, or the preset an override names."""
    if config is None and overrides.get("preset"):
        return CollectConfig.from_preset(**overrides)
    return CollectConfig(**{**asdict(config or CollectConfig()), **overrides})


def resolve_named(model: Any) -> Any:
    """A loaded model as it is; a model name as (the name, its resolved directory), checked before data is read."""
    return (model, resolve_model(model)) if is_path(model) else model


def _read(data: Any, limit: int | None) -> tuple[list, str]:
    """The records read (the first `limit` of them) and checked before a model loads, and the file's fingerprint ('' for
    records)."""
    data_fingerprint, source = "", None
    if isinstance(data, (str, os.PathLike)):
        source, data = data, read_input_jsonl(data)
        data_fingerprint = file_fingerprint(source)
    else:
        data = as_records(list(data))
    data = first_cases(data, limit)
    prompt_cases(data, source)
    return data, data_fingerprint


def load_probed(model: Any, tokenizer: Any, config: Any) -> tuple[Any, Any, dict[str, str]]:
    """(model, tokenizer, per-model metadata) from a (name, directory) pair (`resolve_named`), or a loaded model with
    its tokenizer (passed, or read from the model's directory); `config` (a CollectConfig, or any with its dtype,
    device and device_map) says how to load a directory."""
    if isinstance(model, tuple):
        name, directory = model
        source = {**model_source(name, directory), "model_fingerprint": dir_fingerprint(directory),
                  "model_fingerprint_of": "directory"}
        if config.device_map:
            model, tokenizer = load_placed(directory, config.dtype, config.device_map)
        else:
            model, tokenizer = load_model(directory, dtype=config.dtype, device=rank_device(config.device))
    else:
        source = {"model": model_name(model), "model_dir": "", "model_fingerprint": model_fingerprint(loaded_model(model)),
                  "model_fingerprint_of": "weights"}
        tokenizer = tokenizer_of(model, tokenizer)
    return model, tokenizer, {
        **source,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "attn_implementation": str(getattr(model.config, "_attn_implementation", "")),
    }


def load_placed(path: str | os.PathLike, dtype: str, device_map: DeviceMap) -> tuple[Any, Any]:
    """load_model with accelerate's big-model placement (transformers' `device_map`): the layers spread over
    the GPUs (then the CPU); launched as several processes, over this rank's share of the GPUs (`rank_gpus`)."""
    from accelerate.utils import get_max_memory

    shard, max_memory = shard_from_env(), None
    if shard.world > 1 and torch.cuda.is_available():
        mine = rank_gpus(shard)
        max_memory = {key: size for key, size in get_max_memory().items() if not isinstance(key, int) or key in mine}
    return load_model(path, dtype=dtype, device_map=device_map, max_memory=max_memory)


def rank_device(device: str) -> str:
    """`device`, except that launched as several processes, `auto`/`cuda` is this rank's GPU."""
    shard = shard_from_env()
    if device in ("auto", "cuda") and shard.world > 1 and torch.cuda.is_available():
        return f"cuda:{rank_gpus(shard)[0]}"
    return device


def _cases(data: list, data_fingerprint: str, models: list[Any], tokenizer: Any,
           config: CollectConfig) -> tuple[Cases, dict[str, str]]:
    """Tokenised cases (prompts cut to the shortest context window) and the shared metadata."""
    max_length = shared_window(models, tokenizer, config.max_length)
    cases = build_cases(data, tokenizer, dimension_field=config.dimension_field,
                        generation_prompt=config.generation_prompt, prepend_bos=config.prepend_bos,
                        max_length=max_length)
    return cases, {
        "hook": config.hook, "top_fraction": repr(config.top_fraction), "top_rounding": config.top_rounding,
        "tokens": config.tokens, "rank": config.rank,
        "preset": config.preset, "preset_overrides": ",".join(config.preset_overrides()),
        "top_cases": str(config.top_cases),
        "backend": config.backend, "generation_prompt": str(config.generation_prompt).lower(),
        "prepend_bos": str(config.prepend_bos).lower(),
        "dimension_field": config.dimension_field or "",
        "data_fingerprint": data_fingerprint or cases.fingerprint, "cases_fingerprint": cases.fingerprint,
        "truncated": str(cases.truncated), "max_length": str(max_length), "limit": str(config.limit or ""),
        "resamples": str(config.resamples), "toolkit_version": __version__,
    }


def shared_window(models: list[Any], tokenizer: Any, max_length: int | None) -> int | None:
    """`max_length`, else the shortest context window of the models (None: no known limit)."""
    windows = [w for w in (context_window(m, tokenizer) for m in models) if w]
    return max_length or (min(windows) if windows else None)


def _shape_meta(counter: TopKCounter) -> dict[str, str]:
    return {"k": str(counter.k), "width": str(counter.width), "layers": str(counter.layers)}


def _counts(counter: TopKCounter, cases: Cases, meta: dict[str, str], block: int = 0) -> ProbeCounts:
    """The counter's counts of the full sample (block 0, with the top cases) or of replicate block - 1."""
    counter.check_moments()
    rows = list(enumerate(counter.dimensions, start=block * len(counter.dimensions)))
    top = counter.top is not None and block == 0
    texts = dict(zip(sorted_positions(cases.hashes).tolist(), cases.texts)) if top else {}
    return ProbeCounts(
        count={d: counter.count[j].cpu() for j, d in rows},
        cases={d: int(counter.cases[j]) for j, d in rows},
        observations={d: int(counter.observations[j]) for j, d in rows},
        meta=meta,
        case_hashes=cases.hashes.sort().values,
        act_sum={d: counter.moments[0, :, j].cpu() for j, d in rows},
        act_sq={d: counter.moments[1, :, j].cpu() for j, d in rows},
        top=TopCases.from_keys(counter.top.keys, texts) if top else None,
    )


def count_cases(model: Any, tokenizer: Any, cases: Cases, config: CollectConfig) -> TopKCounter:
    """The hot loop: padded batches through the backend, top-k counted on the model's device. Launched as
    several processes, each counts its share of the batches and the counters are summed over the ranks."""
    counters = _counters([model], cases, config, keep_cases=False)
    _stream([model], counters, tokenizer, cases, config, totals=counters[0].totals)
    return counters[0]


def count_paired(models: list[Any], tokenizer: Any, cases: Cases, config: CollectConfig) -> PairedCounter:
    """count_cases for several models, each batch through every model, then its paired statistics."""
    paired = PairedCounter(_counters(models, cases, config, keep_cases=True))
    _stream(models, paired.counters, tokenizer, cases, config, after_batch=paired.add_batch, totals=paired.totals)
    return paired


def _counters(models: list[Any], cases: Cases, config: CollectConfig, *, keep_cases: bool) -> list[TopKCounter]:
    def counter(model: Any) -> TopKCounter:
        units = width(model, config.hook)
        k = top_k_size(config.top_fraction, units, config.top_rounding)
        return TopKCounter(cases.dimensions, num_layers(model), units, k,
                           tokens=config.tokens, rank=config.rank, device=next(model.parameters()).device,
                           keep_cases=keep_cases, top_cases=config.top_cases, resamples=config.resamples)

    return [counter(m) for m in models]


def _stream(models: list[Any], counters: list[TopKCounter], tokenizer: Any, cases: Cases, config: CollectConfig,
            after_batch: Callable[[torch.Tensor], None] | None = None, totals: Sequence[torch.Tensor] = ()) -> None:
    """This process's batches (`batch_indices`) through every model's backend into its counter, then
    `after_batch(membership)`; at the end `totals` (the counters' sums) are summed over the processes and the
    counters' top cases merged."""
    backends = [make_backend(config.backend, m, config.hook, tokenizer) for m in models]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    positions = sorted_positions(cases.hashes)
    weights = resample_weights(cases.hashes, config.resamples)
    with process_group(counters[0].count.device) as shard:
        mine = sum(map(len, batch_indices(cases, config.batch_size, shard.rank, shard.world)))
        bar = tqdm(total=mine, desc=f"probe {config.hook}", unit="case", disable=not (config.progress and shard.main))
        with torch.inference_mode():
            for idx, input_ids, mask in batches(cases, config.batch_size, pad_id, shard.rank, shard.world):
                membership = with_replicates(cases.membership[idx], weights[:, idx])
                for model, counter, backend in zip(models, counters, backends):
                    device = next(model.parameters()).device
                    counter.start_batch(membership, mask, positions[idx])
                    backend.run(input_ids.to(device), mask.to(device), counter.add)
                    counter.finish_batch()
                if after_batch is not None:
                    after_batch(membership)
                bar.update(len(idx))
        bar.close()
        all_reduce_sum(totals, shard)
        for counter in counters:
            if counter.top is not None:
                counter.top.merge_ranks(all_gather(counter.top.keys, shard))


def collect_to_file(model: Any, data: Any, out: str | os.PathLike, config: CollectConfig | None = None,
                    **overrides: Any) -> Path:
    """collect() and save the probe file; several models (a list) are collected paired (collect_paired).
    Launched as several processes, only rank 0 writes."""
    counts = collect_paired(model, data, config, **overrides) if isinstance(model, (list, tuple)) \
        else collect(model, data, config, **overrides)
    return counts.save(out) if shard_from_env().main else Path(out)
