"""Folding a restraint exactly into weights, written as a standard HF checkpoint."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rolemrc.core.errors import RolemrcError
from rolemrc.core.hooks import hook_point, layout_of, module_at, num_layers
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


def restraint_fold(model: nn.Module, r: Restraint, layer: int) -> Fold:
    """`fold_target` for restraint `r`, refusing what only a scale folds exactly: on a gated MLP, mlp.act is multiplied
    by the up projection's output before the down projection, which scaling commutes with and a constant or a
    projection does not."""
    if r.kind in ("patch", "direction") and r.hook == "mlp.act" and len(mlp_unit_folds(model, layer)) > 2:
        raise RestraintError(f"a {r.kind} at mlp.act cannot be folded into weights on {type(model).__name__}: its "
                             "gated MLP multiplies mlp.act by the up projection before the down projection; restrain "
                             "mlp.post (their product, which folds exactly) or apply it as a runtime hook")
    return fold_target(model, r.hook, layer)


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


Update = tuple[nn.Parameter, tuple, torch.Tensor]   # (parameter, index, its new value there, float32)
BIAS_FLAGS = {"mlp": "mlp_bias", "attn": "attention_bias"}   # Llama-like configs that give a block's projections biases


def fold_updates(model: nn.Module, r: Restraint, reference: nn.Module | None = None) -> Iterator[Update]:
    """Every weight (and bias) slice a bake of `r` writes, with its new value computed in float32 (float64 for a
    projection): scale multiplies the units' slices; patch zeroes them and carries their constants through the
    projection into its bias (`add_biases` first, where the model has none); direction projects the unit vector out
    of the projection's input or output side; revert moves weights toward `reference` by alpha over its scope."""
    validate(r, model)
    if r.kind == "revert":
        yield from revert_updates(model, r, reference)
        return
    for layer in r.sites:
        fold = restraint_fold(model, r, layer)
        weight = fold.untied_weight(model)
        if r.kind == "direction":
            yield from direction_updates(fold, weight, r.directions[layer])
            continue
        units = r.units[layer]
        index = _weight_index(fold, units)
        if r.kind == "scale":
            yield weight, index, weight[index].float() * r.factor
            if fold.scales_bias:
                yield fold.module.bias, (units,), fold.module.bias[units].float() * r.factor
            continue
        bias = fold_bias(fold, r, layer)
        values = torch.tensor(r.values[layer], dtype=torch.float64, device=weight.device)
        if fold.side == "in":   # W (m t + v) + b: the units' columns zeroed, W[:, U] v into the bias
            w = (weight.T if fold.transposed else weight).double()   # [out, in]
            yield bias, (slice(None),), (bias.double() + w[:, units] @ values).float()
        else:                   # m (W x + b) + v: the units' rows zeroed, v their bias
            yield bias, (units,), values.float()
        yield weight, index, torch.zeros_like(weight[index], dtype=torch.float32)


def direction_updates(fold: Fold, weight: nn.Parameter, direction: list[float]) -> Iterator[Update]:
    """A unit vector d projected out of a projection's input (W (I - d d^T)) or output ((I - d d^T) (W x + b))."""
    d = torch.tensor(direction, dtype=torch.float64, device=weight.device)
    w = (weight.T if fold.transposed else weight).double()   # [out, in]
    new = w - torch.outer(w @ d, d) if fold.side == "in" else w - torch.outer(d, d @ w)
    yield weight, (slice(None), slice(None)), (new.T if fold.transposed else new).float()
    if fold.side == "out" and fold.module.bias is not None:
        b = fold.module.bias.double()
        yield fold.module.bias, (slice(None),), (b - d * (d @ b)).float()


def fold_bias(fold: Fold, r: Restraint, layer: int) -> nn.Parameter:
    """The bias a patch writes its constants into, or a RestraintError where the projection has none."""
    if fold.module.bias is None:
        raise RestraintError(f"a patch at {r.hook} bakes as a bias of layer {layer}'s {type(fold.module).__name__}, "
                             "which has none: `add_biases(model, restraint)` first where the config allows one "
                             "(Llama's mlp_bias, attention_bias), else apply the patch as a runtime hook")
    return fold.module.bias


def add_biases(model: nn.Module, r: Restraint) -> list[str]:
    """For a patch: give the projections it folds into a zero bias where they have none, through the model's config
    flag (Llama-like mlp_bias / attention_bias: every projection of that part of every block gets one, so the
    checkpoint loads as the same architecture), an exact no-op; the flags it set. A RestraintError where no flag
    allows it."""
    if r.kind != "patch" or fold_target(model, r.hook, r.sites[0]).module.bias is not None:
        return []
    row = hook_point(r.hook)
    part = "attn" if row.fold.weight == "attn_proj" else "mlp"
    flag = BIAS_FLAGS[part]
    if not hasattr(model.config, flag):
        raise RestraintError(f"a patch at {r.hook} bakes as a bias of the {row.fold.weight} projection, which "
                             f"{type(model).__name__} has none of and whose config cannot add one (no {flag}): apply "
                             "it as a runtime hook (`rolemrc serve`, `intervene.applied`) instead")
    for layer in range(num_layers(model)):
        for module in module_at(model, part, layer)[1].modules():
            if isinstance(module, nn.Linear) and module.bias is None:
                module.bias = nn.Parameter(torch.zeros(module.out_features, dtype=module.weight.dtype,
                                                       device=module.weight.device))
    setattr(model.config, flag, True)
    return [flag]


def revert_updates(model: nn.Module, r: Restraint, reference: nn.Module | None) -> Iterator[Update]:
    """W - alpha (W - W_ref) over the revert's scope: every parameter, those of the blocks of `layers`, or the MLP
    units' slices (their rows of the projections into the MLP's width, their columns of its down projection)."""
    if reference is None:
        raise RestraintError(f"restraint {r.name!r} reverts toward {r.reference.get('name')}: it needs that "
                             "checkpoint loaded as the reference")
    ref = dict(reference.named_parameters())
    for name, param, index in revert_slices(model, r):
        if name not in ref or ref[name].shape != param.shape:
            raise reference_mismatch(r, name, tuple(param.shape))
        here, there = param[index].float(), ref[name][index].to(param.device).float()
        yield param, index, torch.lerp(here, there, r.alpha)   # exact at alpha 0 and 1


def reference_mismatch(r: Restraint, name: str, shape: tuple[int, ...]) -> RestraintError:
    """The error for a revert's reference that lacks the parameter `name` of `shape`."""
    return RestraintError(f"the reference {r.reference.get('name')} has no {name} of shape {shape}: revert toward the "
                          "checkpoint this model was trained from")


def revert_slices(model: nn.Module, r: Restraint) -> Iterator[tuple[str, nn.Parameter, tuple]]:
    """(name, parameter, index) of every slice a revert's scope covers."""
    params = list(model.named_parameters())
    if r.scope != "units":
        blocks = layout_of(model).blocks
        prefixes = tuple(f"{blocks}.{layer}." for layer in r.layers) if r.scope == "layers" else ("",)
        yield from ((n, p, (slice(None),) * p.dim()) for n, p in params if n.startswith(prefixes))
        return
    names = {id(p): n for n, p in params}
    for layer, units in r.units.items():
        for fold in mlp_unit_folds(model, layer):
            yield names[id(fold.module.weight)], fold.module.weight, _weight_index(fold, units)
            if fold.scales_bias:
                yield names[id(fold.module.bias)], fold.module.bias, (units,)


def mlp_unit_folds(model: nn.Module, layer: int) -> list[Fold]:
    """Where an MLP unit lives in layer `layer`'s weights: the output side of each projection into the MLP's width
    (gate and up, or GPT-2's c_fc) and the input side of its down projection."""
    down = fold_target(model, "mlp.post", layer)
    width = down.module.weight.shape[0 if down.transposed else 1]
    into = [Fold(m, "out") for m in module_at(model, "mlp", layer)[1].modules()
            if m is not down.module and getattr(m, "weight", None) is not None and m.weight.dim() == 2]
    return [f for f in into if f.module.weight.shape[1 if f.transposed else 0] == width] + [down]


def fold_restraint(model: nn.Module, r: Restraint, reference: nn.Module | None = None) -> dict[str, int]:
    """Write the bake's updates in place, each computed in float32 and stored back at the weights' dtype; returns
    elements touched per tensor."""
    touched: dict[str, int] = {}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    with torch.no_grad():
        for param, index, value in list(fold_updates(model, r, reference)):
            param[index] = value.to(param.dtype)
            touched[names[id(param)]] = touched.get(names[id(param)], 0) + value.numel()
    return touched


@contextmanager
def folded(model: nn.Module, r: Restraint, reference: nn.Module | None = None) -> Iterator[nn.Module]:
    """`r` baked into `model` in memory for the duration of the block, every touched slice restored on exit: how a
    revert (which has no hook) is measured beside hooked cells on one loaded model. A patch that needs biases the model
    lacks is refused here (it would change the model's structure): measure it as a hook."""
    updates = list(fold_updates(model, r, reference))
    saved = [(param, index, param[index].detach().clone()) for param, index, _ in updates]
    try:
        with torch.no_grad():
            for param, index, value in updates:
                param[index] = value.to(param.dtype)
        del updates
        yield model
    finally:
        with torch.no_grad():
            for param, index, value in saved:
                param[index] = value


def elements_changed(model: nn.Module, r: Restraint, dtype: torch.dtype, reference: nn.Module | None = None) -> int:
    """Weight elements a bake of `r` (computed in float32, stored at `dtype`) changes, without editing `model`."""
    with torch.no_grad():
        return sum(int((value.to(dtype) != p[i].to(dtype)).sum()) for p, i, value in fold_updates(model, r, reference))


@dataclass
class BakeReport:
    out_dir: str | None   # None: a loaded model folded in memory only
    source_fingerprint: str
    dtype: str
    elements_scaled: int
    elements_changed_at_dtype: int
    numerical_noop: bool
    restraint: dict
    size: dict = field(default_factory=dict)   # revert: the share of the model's change from its reference it reverts

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
    ref_dir = reference_dir(r)
    dtype = load_dtype(src, dtype)
    target = resolve_dtype(dtype)
    # at the checkpoint's own dtype each slice is scaled in float32 and stored back as a float32 load would give it;
    # another dtype is read in float32 and cast once, after the fold
    read = target if dtype == checkpoint_dtype(src) else torch.float32
    loaded = AutoModelForCausalLM.from_pretrained(src, dtype=read, local_files_only=True).to(resolve_device(device))
    reference = None if ref_dir is None else AutoModelForCausalLM.from_pretrained(
        ref_dir, dtype=read, local_files_only=True).to(loaded.device)
    validate(r, loaded)
    add_biases(loaded, r)
    changed = elements_changed(loaded, r, target, reference)
    size = restraint_size(loaded, r, reference)
    scaled = fold_restraint(loaded, r, reference)
    report = BakeReport(str(out_dir), dir_fingerprint(src), dtype, sum(scaled.values()), changed, changed == 0,
                        r.to_dict(), size)
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
    ref_dir = reference_dir(r)
    if out_dir is not None:
        refuse_overwrite(out_dir, model_name(model))
        tokenizer = tokenizer_of(model, tokenizer)   # before the model changes: a missing one is an error
    fingerprint = model_fingerprint(model)
    reference = None
    if ref_dir is not None:
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=stored, local_files_only=True).to(model.device)
    add_biases(model, r)
    changed = elements_changed(model, r, stored, reference)
    size = restraint_size(model, r, reference)
    touched = fold_restraint(model, r, reference)
    report = BakeReport(None if out_dir is None else str(out_dir), fingerprint, name, sum(touched.values()), changed,
                        changed == 0, r.to_dict(), size)
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
    if r.kind == "revert":
        return list(dict.fromkeys(name for name, _, _ in revert_slices(model, r)))
    names = {id(p): n for n, p in model.named_parameters()}
    plan = []
    for layer in r.sites:
        fold = fold_target(model, r.hook, layer)
        plan.append(names[id(fold.module.weight)])
        bias = {"scale": fold.scales_bias, "patch": True,
                "direction": fold.side == "out" and fold.module.bias is not None}[r.kind]
        if bias:
            plan.append(names[id(fold.module.bias)])
    return plan


def reference_dir(r: Restraint) -> Path | None:
    """A revert's reference checkpoint, resolved and checked against the fingerprint the spec recorded (before any
    model loads); None for the other kinds."""
    if r.kind != "revert":
        return None
    try:
        found = resolve_model(r.reference["name"])
    except RolemrcError as exc:
        raise RestraintError(f"restraint {r.name!r} reverts toward {r.reference['name']}, which cannot be found: "
                             f"{exc}") from None
    recorded = r.reference.get("fingerprint")
    if recorded and dir_fingerprint(found) != recorded:
        raise RestraintError(f"restraint {r.name!r} reverts toward {r.reference['name']} with fingerprint {recorded}; "
                             f"{found} has {dir_fingerprint(found)}: not the checkpoint the spec was made against")
    return found


def restraint_size(model: nn.Module, r: Restraint, reference: nn.Module | None, *,
                   total: float | None = None) -> dict[str, float]:
    """A revert's size: `reverted_share`, alpha times the share of the squared norm of the model's change from its
    reference (every parameter; `total` where it is known: `squared_change`) that lies in the revert's scope; {} for
    the other kinds (their size is the KL they cause: `sweep.kl`)."""
    if r.kind != "revert" or reference is None:
        return {}
    ref = dict(reference.named_parameters())
    total = squared_change(model, reference) if total is None else total
    with torch.no_grad():
        inside = sum(float((p[i].double() - ref[n][i].double()).pow(2).sum()) for n, p, i in revert_slices(model, r))
    return {"reverted_share": r.alpha * inside / total if total else 0.0, "change_norm": total ** 0.5}


def squared_change(model: nn.Module, reference: nn.Module) -> float:
    """The squared norm of the model's change from its reference over every parameter they share."""
    ref = dict(reference.named_parameters())
    with torch.no_grad():
        return sum(float((p.double() - ref[n].double()).pow(2).sum()) for n, p in model.named_parameters() if n in ref)
