"""`collect`: stream a model over probe cases and count top-k units per layer and dimension."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, get_args

import torch
from tqdm.auto import tqdm

from rolemrc import __version__
from rolemrc.core.io import file_fingerprint, read_jsonl
from rolemrc.core.modeling import dir_fingerprint, load_model, model_fingerprint
from rolemrc.probe.backends import Backend, make_backend
from rolemrc.probe.cases import Cases, batches, build_cases, prompt_cases
from rolemrc.probe.counts import ProbeCounts, Rank, Tokens, TopKCounter, check_top_fraction, top_k_size
from rolemrc.probe.errors import ProbeError, check_choice
from rolemrc.probe.hooks import check_point, num_layers, width


@dataclass
class CollectConfig:
    """How to count (docs/ARCHITECTURE.md "Probe file"). Defaults reproduce the RoleMRC analysis on `mlp.act`."""

    hook: str = "mlp.act"  # a name in HOOK_POINTS
    top_fraction: float = 0.2
    tokens: Tokens = "last"  # "last" prompt token, or "all" prompt tokens (each one observation)
    rank: Rank = "signed"  # or "abs"
    batch_size: int = 16
    backend: Backend = "torch"
    dimension_field: str | None = None
    generation_prompt: bool = True
    max_length: int | None = None  # default: the model's context window
    dtype: str = "float32"
    device: str = "auto"
    progress: bool = True

    def __post_init__(self) -> None:
        check_point(self.hook)
        check_top_fraction(self.top_fraction)
        check_choice("token policy", self.tokens, get_args(Tokens))
        check_choice("rank", self.rank, get_args(Rank))
        check_choice("backend", self.backend, get_args(Backend))


def collect(model: Any, data: Any, config: CollectConfig | None = None, *, tokenizer: Any = None,
            **overrides: Any) -> ProbeCounts:
    """Count how often each unit is in the top `top_fraction` per layer and dimension.

    model: a local HF directory or a loaded causal LM (then pass `tokenizer`).
    data: a JSONL path or a list of records (test, pair or SFT format).
    Keyword overrides replace fields of `config`.
    """
    config = CollectConfig(**{**asdict(config or CollectConfig()), **overrides})
    data_fingerprint = ""
    if isinstance(data, (str, os.PathLike)):  # read and check the data before a model loads
        data_fingerprint = file_fingerprint(data)
        data = read_jsonl(data)
    prompt_cases(data)
    model_path, fingerprint = "", ""
    if isinstance(model, (str, os.PathLike)):
        model_path = str(model)
        fingerprint = dir_fingerprint(model)
        model, tokenizer = load_model(model, dtype=config.dtype, device=config.device)
    elif tokenizer is None:
        raise ProbeError("pass the tokenizer along with a loaded model")
    else:
        fingerprint = model_fingerprint(model)
        model_path = getattr(model.config, "_name_or_path", "") or "<in-memory>"

    max_length = config.max_length or _context_window(model)
    cases = build_cases(data, tokenizer, dimension_field=config.dimension_field,
                        generation_prompt=config.generation_prompt, max_length=max_length)
    counter = count_cases(model, tokenizer, cases, config)
    k, units, layers = counter.k, counter.width, counter.layers

    meta = {
        "model": model_path, "model_fingerprint": fingerprint, "hook": config.hook,
        "top_fraction": repr(config.top_fraction), "k": str(k), "width": str(units), "layers": str(layers),
        "tokens": config.tokens, "rank": config.rank, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "backend": config.backend, "generation_prompt": str(config.generation_prompt).lower(),
        "attn_implementation": str(getattr(model.config, "_attn_implementation", "")),
        "data_fingerprint": data_fingerprint or cases.fingerprint, "cases_fingerprint": cases.fingerprint,
        "truncated": str(cases.truncated), "max_length": str(max_length), "toolkit_version": __version__,
    }
    dims = cases.dimensions
    return ProbeCounts(
        count={d: counter.count[j].cpu() for j, d in enumerate(dims)},
        cases={d: int(counter.cases[j]) for j, d in enumerate(dims)},
        observations={d: int(counter.observations[j]) for j, d in enumerate(dims)},
        meta=meta,
    )


def count_cases(model: Any, tokenizer: Any, cases: Cases, config: CollectConfig) -> TopKCounter:
    """The hot loop: padded batches through the backend, top-k counted on the model's device."""
    units = width(model, config.hook)
    device = next(model.parameters()).device
    counter = TopKCounter(cases.dimensions, num_layers(model), units, top_k_size(config.top_fraction, units),
                          tokens=config.tokens, rank=config.rank, device=device)
    backend = make_backend(config.backend, model, config.hook, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    bar = tqdm(total=len(cases), desc=f"probe {config.hook}", unit="case", disable=not config.progress)
    with torch.inference_mode():
        for idx, input_ids, mask in batches(cases, config.batch_size, pad_id):
            counter.start_batch(cases.membership[idx], mask)
            backend.run(input_ids.to(device), mask.to(device), counter.add)
            counter.finish_batch()
            bar.update(len(idx))
    bar.close()
    return counter


def collect_to_file(model: Any, data: Any, out: str | os.PathLike, config: CollectConfig | None = None,
                    **overrides: Any) -> Path:
    """collect() and save the probe file."""
    return collect(model, data, config, **overrides).save(out)


def _context_window(model: Any) -> int | None:
    cfg = model.config
    return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
