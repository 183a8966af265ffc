"""Naming, loading and fingerprinting Hugging Face causal LMs: a local directory, a model pulled by `rolemrc models
pull`, or a hub id (`org/name[@revision]`, core/hub.py)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any
from weakref import WeakKeyDictionary

import torch

from rolemrc.core.artifacts import describe
from rolemrc.core.errors import InputError
from rolemrc.core.hub import hub_snapshot, looks_like_path, parse_hub_id
from rolemrc.core.io import file_fingerprint, pulled_models
from rolemrc.core.placement import check_dtype

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch dtype from one of DTYPES' names (None and "auto" stay None: the checkpoint's own), else an InputError."""
    if isinstance(dtype, torch.dtype):
        return dtype
    check_dtype(dtype)
    return None if dtype in (None, "auto") else TORCH_DTYPES[dtype]


def checkpoint_dtype(path: str | os.PathLike) -> str:
    """The dtype a HF checkpoint stores its weights in (config.json's `dtype`, or `torch_dtype` before transformers 5),
    float32 where it says none: what `--dtype auto` means, on any device."""
    config = json.loads((check_model_dir(path) / "config.json").read_text())
    stored = config.get("dtype") or config.get("torch_dtype") or "float32"
    return stored if stored in TORCH_DTYPES else "float32"


def load_dtype(path: str | os.PathLike, dtype: str | None) -> str:
    """The dtype name a model directory is loaded at: `dtype`, or its checkpoint's own for "auto" and None."""
    resolve_dtype(dtype)
    return checkpoint_dtype(path) if dtype in (None, "auto") else str(dtype)


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class ModelDirError(InputError, FileNotFoundError):
    """A path that should be a local Hugging Face model directory is not one."""


def check_model_dir(path: str | os.PathLike) -> Path:
    """`path` as a Path if it holds a HF model (a config.json), else ModelDirError; cheap, so callers check
    before they read data or load anything."""
    path = Path(path)
    if not (path / "config.json").is_file():
        if (path / "adapter_config.json").is_file():
            what = ("a PEFT adapter folder, not a model; merge it into its base model first: "
                    "PeftModel.from_pretrained(base, adapter).merge_and_unload().save_pretrained(out)")
        elif not path.exists():
            what = "no such directory"
        else:
            what = f"{describe(path)}, not a Hugging Face model directory (no config.json)"
        raise ModelDirError(f"{path}: {what}")
    return path


def resolve_model(model: str | os.PathLike) -> Path:
    """The local directory a model name stands for, checked to hold a model (cheap: callers resolve before they read
    data or load anything): a path as it is; a bare name, the model pulled under that name (`rolemrc models pull`);
    `org/name[@revision]`, the hub id's snapshot (the HF cache first, the hub when not cached and not offline).
    A ModelDirError or HubModelError names the model and why otherwise."""
    name = os.fspath(model)
    if looks_like_path(name):
        return check_model_dir(Path(name).expanduser())
    if "/" not in name and "@" not in name:
        pulled = pulled_models() / name
        if (pulled / "config.json").is_file():
            return pulled
        raise ModelDirError(f"{name}: no such directory, and no model of that name pulled into {pulled_models()} "
                            "(rolemrc models list; rolemrc models pull NAME), nor a hub id (org/name)")
    return check_model_dir(hub_snapshot(parse_hub_id(name)))


def meta_model(directory: Path) -> Any:
    """The model of a checkpoint directory built on PyTorch's meta device (float32): its modules and shapes, no
    weights read or allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def model_source(model: str | os.PathLike, directory: Path) -> dict[str, str]:
    """Metadata of a model loaded from a name: `model` as the user named it (a path, pulled name or hub id with its
    revision) and `model_dir`, the directory it resolved to (for a hub id, its snapshot)."""
    return {"model": os.fspath(model), "model_dir": str(directory)}


def is_path(model: Any) -> bool:
    """Whether `model` names a directory (a str or path) rather than being a loaded model."""
    return isinstance(model, (str, os.PathLike))


def refuse_unmerged_peft(model: Any) -> None:
    """An InputError for a PEFT-wrapped model (a PeftModel, or a model with PEFT's adapter layers in it, as
    transformers' `load_adapter` leaves one): restraints name the base model's modules, and an unmerged adapter would
    sit beside them unaccounted for. A merged model (`merge_and_unload()`) has no adapter layers left and passes,
    though peft leaves its `peft_config` attribute behind."""
    layers = model.modules() if isinstance(model, torch.nn.Module) else ()
    if type(model).__module__.split(".")[0] == "peft" or any(type(m).__module__.startswith("peft.") for m in layers):
        raise InputError(f"a {type(model).__name__} with PEFT adapters: merge them into the model first "
                         "(model = model.merge_and_unload()), then pass the merged model")


def loaded_model(model: Any) -> Any:
    """`model` if it is a loaded transformers model rolemrc can hook and edit, else an InputError (a PEFT-wrapped one:
    merge it first)."""
    refuse_unmerged_peft(model)
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise InputError(f"expected a model directory or a loaded transformers model, got {type(model).__name__}")
    return model


def model_name(model: Any) -> str:
    """What a loaded model was loaded from (its config's `_name_or_path`), or "<in-memory>"."""
    return getattr(model.config, "_name_or_path", "") or "<in-memory>"


def tokenizer_of(model: Any, tokenizer: Any = None) -> Any:
    """`tokenizer`, or the one saved beside a loaded model's local directory, else an InputError asking for it."""
    if tokenizer is not None:
        return tokenizer
    source = Path(model_name(model))
    if not source.is_dir():
        raise InputError(f"pass tokenizer= along with the loaded model ({model_name(model)} is not a local directory "
                         "to read its tokenizer from)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(model: str | os.PathLike, *, dtype: str | torch.dtype | None = "auto", device: str | None = "auto",
               device_map: str | dict | None = None, max_memory: dict | None = None):
    """Load (model, tokenizer) from a model name (`resolve_model`), in eval mode, at `dtype` ("auto": the
    checkpoint's own, on any device) on `device` ("auto": a GPU when there is one).

    `device_map` (with optional `max_memory`) places the layers with accelerate's big-model loading instead of
    moving the whole model to `device`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(model)
    dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(load_dtype(path, dtype))
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    placement = {"device_map": device_map, "max_memory": max_memory} if device_map else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **placement)
    if not device_map:
        model.to(resolve_device(device))
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def context_window(model_or_config: Any, tokenizer: Any = None, *, default: int | None = None) -> int | None:
    """The most positions a model takes, the first set of: its config's `max_position_embeddings`, its
    `n_positions` (GPT-2 style configs), the tokenizer's `model_max_length` (not transformers' placeholder for
    an unknown length), `default` (None: no known limit)."""
    config = getattr(model_or_config, "config", model_or_config)
    window = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not window and tokenizer is not None:
        from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

        length = getattr(tokenizer, "model_max_length", None)
        window = length if length and length < VERY_LARGE_INTEGER else None
    return int(window) if window else default


DIR_FINGERPRINTS: dict[tuple, str] = {}   # (path, its files' names, sizes and times) -> fingerprint
WEIGHT_FINGERPRINTS: WeakKeyDictionary = WeakKeyDictionary()   # loaded model -> (its tensors' versions, fingerprint)


def dir_fingerprint(path: str | os.PathLike) -> str:
    """Fingerprint of a model's config and weights (a model name: `resolve_model`; cached while its files keep their
    sizes and times; a hub snapshot's symlinks are followed into the cache's blobs)."""
    path = resolve_model(path)
    files = [p for p in sorted(path.iterdir()) if p.name == "config.json" or p.suffix in (".safetensors", ".bin")]
    key = (str(path.resolve()), *((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    if key not in DIR_FINGERPRINTS:
        digest = hashlib.sha256()
        for file in files:
            digest.update(file.name.encode() + file_fingerprint(file).encode())
        DIR_FINGERPRINTS[key] = digest.hexdigest()[:16]
    return DIR_FINGERPRINTS[key]


def model_fingerprint(model: Any) -> str:
    """Fingerprint of an in-memory model: its config and every parameter's bytes (cached while no tensor of it
    changes: torch counts each in-place write in the tensor's version)."""
    versions = tuple(t._version for t in (*model.parameters(), *model.buffers()))
    cached = WEIGHT_FINGERPRINTS.get(model)
    if cached and cached[0] == versions:
        return cached[1]
    digest = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    WEIGHT_FINGERPRINTS[model] = (versions, digest.hexdigest()[:16])
    return WEIGHT_FINGERPRINTS[model][1]


def fingerprints(model: Any, of: str = "") -> dict[str, str]:
    """The fingerprints of `model` (a directory or a loaded model) of kind `of` ("directory", "weights", or "" for
    any) that can be had without loading: a directory's from its files; a loaded model's from its tensors, and its
    directory's when it was loaded from one."""
    found: dict[str, str] = {}
    if is_path(model):
        if of in ("", "directory"):
            found["directory"] = dir_fingerprint(model)
        return found
    source = Path(model_name(model))
    if of in ("", "directory") and (source / "config.json").is_file():
        found["directory"] = dir_fingerprint(source)
    if of in ("", "weights") and not next(model.parameters()).is_meta:   # a skeleton has no weights to hash
        found["weights"] = model_fingerprint(loaded_model(model))
    return found
