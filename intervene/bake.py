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

from rolemrc.core.modeling import check_model_dir, checkpoint_dtype, dir_fingerprint, resolve_dtype
from rolemrc.core.version import __version__
from rolemrc.intervene.spec import Restraint, RestraintError
from rolemrc.probe.hooks import hook_point, module_at


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
    r.validate(model)
    for layer, units in r.units.items():
        fold = fold_target(model, r.hook, layer)
        yield fold.untied_weight(model), _weight_index(fold, units)
        if fold.scales_bias:
            yield fold.module.bias, (units,)


def fold_restraint(model: nn.Module, r: Restraint) -> dict[str, int]:
    """Scale the weights in place (float math in the weights' dtype); returns elements touched per tensor."""
    touched: dict[str, int] = {}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    with torch.no_grad():
        for param, index in list(fold_sites(model, r)):
            param[index] *= r.factor
            touched[names[id(param)]] = param[index].numel()
    return touched


def elements_changed(model: nn.Module, r: Restraint, dtype: torch.dtype) -> int:
    """Weight elements a bake of `r` (scaled in float32, stored at `dtype`) changes, without editing `model`."""
    with torch.no_grad():
        return sum(int(((p[i].float() * r.factor).to(dtype) != p[i].to(dtype)).sum()) for p, i in fold_sites(model, r))


@dataclass
class BakeReport:
    out_dir: str
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


def fold_and_count(model: nn.Module, r: Restraint, dtype: torch.dtype) -> tuple[dict[str, int], int]:
    """Fold `r` into a float32 `model` in place: (elements scaled per tensor, elements that differ from the
    original once both are stored at `dtype`), i.e. what a bake at `dtype` writes."""
    r.validate(model)
    names = set(fold_restraint_plan(model, r))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n in names}
    scaled = fold_restraint(model, r)
    return scaled, changed_elements(before, {n: p.detach() for n, p in model.named_parameters() if n in names}, dtype)


def provenance_metadata(src: Path, fingerprint: str, r: Restraint) -> dict[str, str]:
    """safetensors metadata of a file derived from the model in `src` by the restraint `r`."""
    return {"format": "pt", "rolemrc_source_model": str(src), "rolemrc_source_fingerprint": fingerprint,
            "rolemrc_restraint": json.dumps(r.to_dict(), sort_keys=True), "rolemrc_version": __version__}


def bake(model_dir: str | os.PathLike, restraint: Any, out_dir: str | os.PathLike, dtype: str = "float32") -> BakeReport:
    """Fold `restraint` into a copy of the model in `model_dir` (scaled in float32, stored at `dtype`; "auto": the
    checkpoint's own) and write a standard HF checkpoint whose safetensors metadata records the source fingerprint
    and the spec."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r = Restraint.from_any(restraint)
    src, out = check_model_dir(model_dir), Path(out_dir)
    if out.resolve() == src.resolve():
        raise RestraintError("bake output must differ from the source model directory")
    dtype = checkpoint_dtype(src) if dtype == "auto" else dtype
    target = resolve_dtype(dtype)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, local_files_only=True)
    scaled, changed = fold_and_count(model, r, target)

    if out.exists():
        shutil.rmtree(out)
    model.to(target).save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(src, local_files_only=True).save_pretrained(out)
    fingerprint = dir_fingerprint(src)
    metadata = provenance_metadata(src, fingerprint, r)
    for file in sorted(out.glob("*.safetensors")):
        save_file(load_file(file), str(file), metadata=metadata)
    report = BakeReport(str(out), fingerprint, dtype, sum(scaled.values()), changed, changed == 0, r.to_dict())
    (out / "rolemrc.json").write_text(json.dumps({"stage": "bake", "source_model": str(src), **report.to_dict()},
                                                 indent=1, sort_keys=True))
    return report


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
