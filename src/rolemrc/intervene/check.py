"""`check`: run sample prompts through the original, hooked and baked models and say what changed.

The no-op verdict judges the weights a bake writes: the folded weights at the stored dtype (read from
the baked checkpoint, or folded here as `bake` would) against the original weights cast to that dtype,
the same count `bake` reports. The runtime hook is judged separately (its factor rounded to the run
dtype), so a bake that changes weights while the hook is an identity at that dtype is reported as such."""

from __future__ import annotations

import copy
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from rolemrc.core.chat import render_chat
from rolemrc.core.modeling import (
    check_model_dir,
    is_path,
    load_dtype,
    load_model,
    loaded_model,
    resolve_dtype,
    resolve_model,
    tokenizer_of,
)
from rolemrc.core.placement import check_placement
from rolemrc.core.records import as_turns
from rolemrc.intervene.bake import (
    add_biases,
    changed_elements,
    elements_changed,
    fold_restraint,
    fold_restraint_plan,
    reference_dir,
)
from rolemrc.intervene.fit import check_origin, validate
from rolemrc.intervene.runtime import applied
from rolemrc.intervene.spec import Restraint, RestraintError, as_restraint

SAMPLE_PROMPTS = (
    [{"role": "system", "content": "You are a lighthouse keeper on a stormy coast."},
     {"role": "user", "content": "What do you see tonight?"}],
    [{"role": "user", "content": "Passage: The river floods every spring. Question: When does the river flood?"}],
    [{"role": "system", "content": "You are a baker. Refuse questions outside baking."},
     {"role": "user", "content": "Explain quantum tunnelling."},
     {"role": "assistant", "content": "That is beyond my ovens, friend."},
     {"role": "user", "content": "Please, just answer anyway."}],
)


@dataclass
class CheckReport:
    restraint: str
    hook: str
    units: int
    factor: float
    dtype: str                      # the logits' dtype (the runtime hook runs at it)
    factor_at_dtype: float | None   # a scale's factor at `dtype` (1.0: its hook is an identity there); None: other kinds
    numerical_noop: bool            # the bake writes no changed weight element (weight_elements_changed == 0)
    weight_elements_changed: int    # baked vs original weights, both at weights_dtype (bake's own count)
    weights_dtype: str              # the baked checkpoint's stored dtype, or `dtype` without one
    hook_vs_original_max_abs: float
    baked_vs_original_max_abs: float | None = None
    baked_vs_hook_max_abs: float | None = None
    baked_vs_hook_max_rel: float | None = None
    verdict: str = ""
    notes: list[str] = field(default_factory=list)
    kind: str = "scale"             # the restraint's kind; a revert has no hook: "hook" is its bake in memory

    def to_dict(self) -> dict:
        return asdict(self)


def _logits(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.inference_mode():
        out = model(**batch).logits.float()
    return out[batch["attention_mask"].bool()]  # real tokens only


def _batch(tokenizer: Any, prompts: list[str | list[dict]], device: torch.device) -> dict[str, torch.Tensor]:
    """Prompts (plain strings or chat turn lists) rendered with the chat template, right-padded."""
    tokenizer.padding_side = "right"
    texts = [render_chat(tokenizer, as_turns(p)) for p in prompts]
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)


def hook_shift(model: Any, tokenizer: Any, r: Restraint, prompts: list[str | list[dict]] | None = None) -> float:
    """The largest |logit change| the runtime hook causes on `prompts` (default: the sample prompts)."""
    batch = _batch(tokenizer, list(prompts or SAMPLE_PROMPTS), next(model.parameters()).device)
    original = _logits(model, batch)
    with applied(model, r):
        return float((_logits(model, batch) - original).abs().max())


def stored_weights(baked_dir: str | os.PathLike, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors as a baked checkpoint stores them (its own dtype)."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(baked_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            stored = set(fh.keys())
            found |= {n: fh.get_tensor(n) for n in names if n in stored}
    missing = [n for n in names if n not in found]
    if missing:
        raise RestraintError(f"{baked_dir}: no {missing[0]} in its safetensors; was it baked from this model?")
    return found


def weights_changed(model: Any, r: Restraint, baked_dir: str | os.PathLike | None, target: torch.dtype,
                    reference: Any = None) -> tuple[int, torch.dtype]:
    """(weight elements a bake changes, the dtype they were compared at): the baked checkpoint's tensors against
    the original ones (a model directory read in float32, or the loaded model's own) cast to their dtype, or, without
    a checkpoint, a fold at `target` as bake does (a revert's toward its loaded `reference`)."""
    loaded = load_model(model, dtype="float32", device="cpu")[0] if is_path(model) else model
    validate(r, loaded)
    if baked_dir is None:
        if reference is not None:
            reference = reference.to(next(loaded.parameters()).device)
        patched = copy.deepcopy(loaded) if r.kind == "patch" else loaded   # a patch may add zero biases first
        add_biases(patched, r)
        return elements_changed(patched, r, target, reference), target
    names = fold_restraint_plan(loaded, r)
    baked = stored_weights(baked_dir, names)
    stored = baked[names[0]].dtype
    original = {n: p.detach().cpu() for n, p in loaded.named_parameters() if n in baked}
    return changed_elements(original, baked, stored), stored


def check(model: Any, restraint: Any, baked_dir: str | os.PathLike | None = None,
          prompts: list[str | list[dict]] | None = None, dtype: str | None = "auto", device: str = "auto", *,
          device_map: str | None = None, tokenizer: Any = None, strict: bool = False) -> CheckReport:
    """Compare original, runtime-hooked and (optionally) baked logits; count the weight elements the bake changes (in
    `baked_dir`'s stored dtype, else at the run dtype), and call it a numerical no-op only when that count is 0.

    `model` is a model name (a HF model directory, a pulled model's name or a hub id), loaded at `dtype` ("auto": the
    checkpoint's own) on `device` (or placed by `device_map`), or a loaded transformers model, run as it is (its own
    dtype and device) with `tokenizer` (default: the one in its directory). Prompts are plain strings or chat turn lists
    (default: three sample prompts)."""
    r = as_restraint(restraint)
    check_placement(device, device_map)
    model = resolve_model(model) if is_path(model) else loaded_model(model)
    check_origin(r, model, strict)   # another model: a warning, or refused
    if baked_dir is not None:
        check_model_dir(baked_dir)
    if is_path(model):
        dtype = load_dtype(model, dtype)
        loaded, tok = load_model(model, dtype=dtype, device=device, device_map=device_map)
    else:
        loaded, tok = loaded_model(model), tokenizer_of(model, tokenizer)
        own = str(next(loaded.parameters()).dtype).removeprefix("torch.")
        if dtype not in (None, "auto", own):
            raise RestraintError(f"a loaded model is checked at its own dtype ({own}), not {dtype}; cast it first "
                                 "or leave dtype out")
        dtype, device = own, str(next(loaded.parameters()).device)
    target = resolve_dtype(dtype)
    validate(r, loaded)
    ref_dir = reference_dir(r)
    reference = None if ref_dir is None else load_model(ref_dir, dtype=dtype, device="cpu")[0]
    batch = _batch(tok, list(prompts or SAMPLE_PROMPTS), next(loaded.parameters()).device)
    original = _logits(loaded, batch)
    if r.hooked:
        with applied(loaded, r):
            hooked = _logits(loaded, batch)
    else:   # a revert is baked: its bake in memory stands where the hook would
        reverted = copy.deepcopy(loaded)
        fold_restraint(reverted, r, reference.to(next(loaded.parameters()).device))
        hooked = _logits(reverted, batch)
        del reverted
    changed, stored = weights_changed(model if is_path(model) else loaded, r, baked_dir, target, reference)
    at_dtype = float(torch.tensor(r.factor, dtype=target)) if r.kind == "scale" else None
    report = CheckReport(r.name, r.hook, r.num_units, r.factor, dtype, at_dtype,
                         numerical_noop=changed == 0, weight_elements_changed=changed,
                         weights_dtype=str(stored).removeprefix("torch."),
                         hook_vs_original_max_abs=float((hooked - original).abs().max()), kind=r.kind)
    if baked_dir is not None:
        baked = _logits(load_model(baked_dir, dtype=dtype, device=device, device_map=device_map)[0], batch)
        diff = (baked - hooked).abs()
        report.baked_vs_original_max_abs = float((baked - original).abs().max())
        report.baked_vs_hook_max_abs = float(diff.max())
        report.baked_vs_hook_max_rel = float(diff.max() / hooked.abs().max().clamp_min(1e-12))
    report.verdict = _verdict(report)
    report.notes = _notes(report)
    return report


def _verdict(c: CheckReport) -> str:
    moved = c.hook_vs_original_max_abs
    hook = "leaves logits identical" if moved == 0 else f"moves logits by up to {moved:.3g}"
    if c.numerical_noop:
        why = (f" (factor {c.factor!r} is {c.factor_at_dtype!r} in {c.dtype})" if c.kind == "scale" else
               f" (a {c.kind})")
        return (f"NUMERICAL NO-OP: the bake changes no weight element at {c.weights_dtype}{why}; the runtime hook "
                f"{hook}. Use float32 or a larger restraint that survives this dtype.")
    baked = "" if c.baked_vs_hook_max_abs is None else (
        f"; baked logits move by up to {c.baked_vs_original_max_abs:.3g} and differ from hooked by up to "
        f"{c.baked_vs_hook_max_abs:.3g}")
    return f"effective: {c.weight_elements_changed} weight elements change at {c.weights_dtype}; the runtime hook {hook}{baked}"


def _notes(c: CheckReport) -> list[str]:
    notes = []
    if c.factor_at_dtype == 1.0 and not c.numerical_noop:
        notes.append(f"the runtime hook is an identity at {c.dtype} (factor {c.factor!r} rounds to 1.0) but the bake "
                     f"scales in float32 before storing at {c.weights_dtype}, so {c.weight_elements_changed} weight "
                     "elements change and hooked and baked models disagree; hook at float32 or bake at float32 to match")
    elif c.hook_vs_original_max_abs == 0 and not c.numerical_noop:
        notes.append("weights change but the sample prompts' logits did not move under the runtime hook")
    if c.numerical_noop and c.hook_vs_original_max_abs > 0:
        notes.append(f"the runtime hook moves logits at {c.dtype} though the bake writes unchanged weights")
    if c.weights_dtype != c.dtype:
        notes.append(f"the baked weights are stored at {c.weights_dtype}; logits were compared at {c.dtype}")
    return notes
