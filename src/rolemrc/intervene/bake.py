"""Folding a restraint exactly into weights, written as a standard HF checkpoint."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rolemrc.core.hooks import hook_point, module_at
from rolemrc.core.modeling import (
    checkpoint_dtype,
    dir_fingerprint,
    is_path,
    load_dtype,
    loaded_model,
    model_fingerprint,
    model_name,
    model_source,
    resolve_device,
    resolve_dtype,
    resolve_model,
    tokenizer_of,
)
from rolemrc.core.version import __version__
from rolemrc.intervene.fit import check_origin, validate
from rolemrc.intervene.spec import Restraint, RestraintError, as_restraint


@dataclass(frozen=True)
class Fold:
    """Which projection's weight absorbs the scaling, and along which side of it."""

    module: nn.Module
    side: str  # "in": the projection's input units; "out": its output units (and its bias)

    @property
    def scales_bias(self) -> bool:
        return self.side == "out" and getattr(self.module, "bias", None) is not None

    @property
    def transposed(self) -> bool:
        """nn.Linear stores [out, in]; GPT-2's Conv1D stores [in, out]."""
        return type(self.module).__name__ == "Conv1D"

    def untied_weight(self, model: nn.Module) -> nn.Parameter:
        """The projection's weight, or a RestraintError when it is tied to another parameter (editing it
        would edit both)."""
        weight = self.module.weight
        shared = [n for n, p in model.named_parameters(remove_duplicate=False) if p is weight]
        if len(shared) > 1:
            raise RestraintError(f"cannot edit {shared[0]}: it is tied to {shared[1:]}")
        return weight


def fold_target(model: nn.Module, hook: str, layer: int) -> Fold:
    """The projection and side the hook point's row in HOOK_POINTS names (e.g. mlp.act -> input units of
    the MLP's down projection), or a RestraintError for a point that cannot be folded."""
    row = hook_point(hook)
    if row.fold is None:
        why = f": {row.no_fold}" if row.no_fold else ""
        raise RestraintError(f"{hook} cannot be folded into weights exactly{why}; use the runtime hook instead")
    return Fold(module_at(model, row.fold.weight, layer)[1], row.fold.side)


def lora_exportable(model: nn.Module, hook: str) -> bool:
    """Whether a restraint at `hook` can ship as a LoRA adapter on `model`: its row allows it and the fold
    scales no bias (a LoRA adapter only adds to weights)."""
    row = hook_point(hook)
    return row.lora and row.fold is not None and not fold_target(model, hook, 0).scales_bias


def _weight_index(fold: Fold, units: list[int]) -> tuple[slice | list[int], ...]:
    """Index of the weight elements that scale with the units (as stored: see `Fold.transposed`)."""
    in_axis = 0 if fold.transposed else 1
    axis = in_axis if fold.side == "in" else 1 - in_axis
    return (units, slice(None)) if axis == 0 else (slice(None), units)


def fold_sites(model: nn.Module, r: Restraint) -> Iterator[tuple[nn.Parameter, tuple]]:
    """(parameter, index) of every weight (and bias) slice that folding `r` scales."""
    validate(r, model)
    for layer, units in r.units.items():
        fold = fold_target(model, r.hook, layer)
        yield fold.untied_weight(model), _weight_index(fold, units)
        if fold.scales_bias:
            yield fold.module.bias, (units,)


def fold_restraint(model: nn.Module, r: Restraint) -> dict[str, int]:
    """Scale the weights in place, each slice computed in float32 and stored back at the weights' dtype; returns
    elements touched per tensor."""
    touched: dict[str, int] = {}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    with torch.no_grad():
        for param, index in list(fold_sites(model, r)):
            param[index] = (param[index].float() * r.factor).to(param.dtype)
            touched[names[id(param)]] = param[index].numel()
    return touched


def elements_changed(model: nn.Module, r: Restraint, dtype: torch.dtype) -> int:
    """Weight elements a bake of `r` (scaled in float32, stored at `dtype`) changes, without editing `model`."""
    with torch.no_grad():
        return sum(int(((p[i].float() * r.factor).to(dtype) != p[i].to(dtype)).sum()) for p, i in fold_sites(model, r))


@dataclass
class BakeReport:
    out_dir: str | None   # None: a loaded model folded in memory only
    source_fingerprint: str
    dtype: str
    elements_scaled: int
    elements_changed_at_dtype: int
    numerical_noop: bool
    restraint: dict

    def to_dict(self) -> dict:
        return asdict(self)


def changed_elements(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], dtype: torch.dtype) -> int:
    """How many weight elements differ once both sides are stored at `dtype`."""
    return sum(int((before[n].to(dtype) != after[n].to(dtype)).sum()) for n in before)


def provenance_metadata(source: str, fingerprint: str, r: Restraint) -> dict[str, str]:
    """safetensors metadata of a file derived from the model `source` (its directory or name) by the restraint `r`."""
    return {"format": "pt", "rolemrc_source_model": str(source), "rolemrc_source_fingerprint": fingerprint,
            "rolemrc_restraint": json.dumps(r.to_dict(), sort_keys=True), "rolemrc_version": __version__}


def bake(model: Any, restraint: Any, out_dir: str | os.PathLike | None = None, dtype: str | None = "auto", *,
         device: str = "auto", tokenizer: Any = None, strict: bool = False) -> BakeReport:
    """Fold `restraint` into a model's weights, scaled in float32 and stored at `dtype`.

    `model` is a model name (a HF model directory, a pulled model's name or a hub id; written as a standard HF
    checkpoint in `out_dir`, which it requires; `dtype` "auto": the checkpoint's own, so a bf16 checkpoint stays bf16)
    folded on `device` ("auto": a GPU when there is one), or a loaded transformers model, which is folded in place at
    its own dtype (like PEFT's `merge_and_unload`) and also saved to `out_dir` when given, with `tokenizer` (default:
    the one in the model's directory, if any). The checkpoint's safetensors metadata and its rolemrc.json record the
    source (as named, and the directory it resolved to), its fingerprint and the spec."""
    r = as_restraint(restraint)
    if not is_path(model):
        check_origin(r, loaded_model(model), strict)   # another model: a warning, or refused
        return bake_loaded(loaded_model(model), r, out_dir, dtype, tokenizer)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_model(model)
    check_origin(r, src, strict)
    if out_dir is None:
        raise RestraintError(f"bake of the model directory {src} needs out_dir, the checkpoint to write")
    refuse_overwrite(out_dir, src)
    dtype = load_dtype(src, dtype)
    target = resolve_dtype(dtype)
    # at the checkpoint's own dtype each slice is scaled in float32 and stored back as a float32 load would give it;
    # another dtype is read in float32 and cast once, after the fold
    read = target if dtype == checkpoint_dtype(src) else torch.float32
    loaded = AutoModelForCausalLM.from_pretrained(src, dtype=read, local_files_only=True).to(resolve_device(device))
    validate(r, loaded)
    changed = elements_changed(loaded, r, target)
    scaled = fold_restraint(loaded, r)
    report = BakeReport(str(out_dir), dir_fingerprint(src), dtype, sum(scaled.values()), changed, changed == 0,
                        r.to_dict())
    source = model_source(model, src)
    write_baked(loaded.to(target), AutoTokenizer.from_pretrained(src, local_files_only=True), source, report, r)
    return report


def bake_loaded(model: nn.Module, r: Restraint, out_dir: str | os.PathLike | None, dtype: str | None,
                tokenizer: Any) -> BakeReport:
    """`bake` of a loaded model: folded in place, each scaled slice computed in float32 and stored back at the
    weights' own dtype (which `dtype`, if given, must name)."""
    stored = next(model.parameters()).dtype
    name = str(stored).removeprefix("torch.")
    if dtype not in (None, "auto", name):
        raise RestraintError(f"a loaded model is baked at its own dtype ({name}), not {dtype}; cast it first "
                             "(model.to(torch.float32)) or leave dtype out")
    validate(r, model)
    if out_dir is not None:
        refuse_overwrite(out_dir, model_name(model))
        tokenizer = tokenizer_of(model, tokenizer)   # before the model changes: a missing one is an error
    fingerprint = model_fingerprint(model)
    changed = elements_changed(model, r, stored)
    touched = fold_restraint(model, r)
    report = BakeReport(None if out_dir is None else str(out_dir), fingerprint, name, sum(touched.values()), changed,
                        changed == 0, r.to_dict())
    if out_dir is not None:
        write_baked(model, tokenizer, {"model": model_name(model), "model_dir": ""}, report, r)
    return report


def refuse_overwrite(out_dir: str | os.PathLike, source: str | os.PathLike) -> None:
    """A RestraintError when `out_dir` is the source model's own directory."""
    if Path(source).exists() and Path(out_dir).resolve() == Path(source).resolve():
        raise RestraintError(f"bake output {out_dir} must differ from the source model directory")


def write_baked(model: nn.Module, tokenizer: Any, source: dict[str, str], report: BakeReport, r: Restraint) -> None:
    """Save a folded model and its tokenizer to `report.out_dir` as a HF checkpoint whose safetensors metadata and
    rolemrc.json record where it came from (`source`: `core.modeling.model_source`)."""
    from safetensors.torch import load_file, save_file

    out = Path(report.out_dir)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    metadata = provenance_metadata(source["model"], report.source_fingerprint, r)
    for file in sorted(out.glob("*.safetensors")):
        save_file(load_file(file), str(file), metadata=metadata)
    provenance = {"stage": "bake", "source_model": source["model"], "source_dir": source["model_dir"]}
    (out / "rolemrc.json").write_text(json.dumps({**provenance, **report.to_dict()}, indent=1, sort_keys=True))


def fold_restraint_plan(model: nn.Module, r: Restraint) -> list[str]:
    """Names of the parameters a bake would touch."""
    names = {id(p): n for n, p in model.named_parameters()}
    plan = []
    for layer in r.units:
        fold = fold_target(model, r.hook, layer)
        plan.append(names[id(fold.module.weight)])
        if fold.scales_bias:
            plan.append(names[id(fold.module.bias)])
    return plan
