"""A restraint exported as an exact LoRA adapter (standard PEFT layout, servable by PEFT and vLLM).

Scaling units of one projection's input (columns U of W) or output (rows R) by f is the rank-|U| edit
W[:, U] (f - 1) e_U^T (resp. e_R (f - 1) W[R, :]), so with lora_alpha = r (scaling 1) B @ A is exactly the
bake's weight change: the fold's side in HOOK_POINTS decides which factor is one-hot.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rolemrc import __version__
from rolemrc.core.modeling import check_model_dir, dir_fingerprint
from rolemrc.intervene.bake import Fold, fold_target, lora_exportable, provenance_metadata
from rolemrc.intervene.spec import Restraint, RestraintError
from rolemrc.probe.hooks import hook_point, layout_of, module_at

VLLM_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


@dataclass
class LoraReport:
    out_dir: str
    rank: int
    max_units: int
    target_modules: list[str]
    layers: list[int]
    source_fingerprint: str
    restraint: dict

    def to_dict(self) -> dict:
        return asdict(self)


def lora_rank(max_units: int, rank: int | None = None) -> int:
    """`rank` if given (at least `max_units`), else the smallest vLLM rank that holds `max_units` (or
    `max_units` itself beyond them)."""
    if rank is not None:
        if rank < max_units:
            raise RestraintError(f"rank {rank} is below the {max_units} units of the largest layer")
        return rank
    return next((v for v in VLLM_RANKS if v >= max_units), max_units)


def lora_pair(fold: Fold, units: list[int], factor: float, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [rank, in], B [out, rank]) in float32 with B @ A equal to the fold's weight change, zero-padded."""
    w = fold.module.weight.detach().float()
    w = w.T if fold.transposed else w  # [out, in]
    idx = torch.tensor(units)
    if fold.side == "in":
        a, b = F.one_hot(idx, w.shape[1]).float(), w[:, idx] * (factor - 1)
    else:
        a, b = w[idx, :], F.one_hot(idx, w.shape[0]).float().T * (factor - 1)
    pad = rank - len(units)
    return F.pad(a, (0, 0, 0, pad)).contiguous(), F.pad(b, (0, pad)).contiguous()


def _target_name(model: nn.Module, role: str) -> str:
    """The target_modules entry of a layout role: its bare name (down_proj, as PEFT and vLLM expect), or its
    path inside the block where the bare name is ambiguous (GPT-2's mlp.c_proj vs attn.c_proj)."""
    path = layout_of(model).modules[role]
    bare = path.rsplit(".", 1)[-1]
    clashes = sum(n.rsplit(".", 1)[-1] == bare for n, _ in module_at(model, "block", 0)[1].named_modules())
    return bare if clashes == 1 else path


def _exportable_fold(model: nn.Module, r: Restraint, layer: int) -> Fold:
    """The fold of `r` in `layer`, or a RestraintError saying why LoRA cannot express it exactly."""
    fold = fold_target(model, r.hook, layer)  # refuses, with the row's reason, points that cannot fold
    if not lora_exportable(model, r.hook):
        why = ("the fold also scales the projection's bias, and a LoRA adapter only adds to weights"
               if fold.scales_bias else "its HOOK_POINTS row does not allow LoRA")
        raise RestraintError(f"{r.hook} cannot be exported as an exact LoRA adapter: {why}; bake it instead")
    fold.untied_weight(model)
    return fold


def export_lora(model_dir: str | os.PathLike, spec: Any, out_dir: str | os.PathLike, *,
                rank: int | None = None) -> LoraReport:
    """Write `spec` as a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for the model in
    `model_dir`: B @ A equals the bake's weight change, computed in float32 from the model's weights."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    r = Restraint.from_any(spec)
    src, out = check_model_dir(model_dir), Path(out_dir)
    if out.resolve() == src.resolve():
        raise RestraintError("LoRA output must differ from the source model directory")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, local_files_only=True)
    r.validate(model)
    max_units = max(len(u) for u in r.units.values())
    r_pad = lora_rank(max_units, rank)
    names = {id(m): n for n, m in model.named_modules()}
    tensors = {}
    for layer, units in r.units.items():
        fold = _exportable_fold(model, r, layer)
        a, b = lora_pair(fold, units, r.factor, r_pad)
        key = f"base_model.model.{names[id(fold.module)]}"
        tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b

    fingerprint = dir_fingerprint(src)
    row = hook_point(r.hook)
    targets = [_target_name(model, row.fold.weight)]
    provenance = {"source_model": str(src), "source_fingerprint": fingerprint, "restraint": r.to_dict(),
                  "source": r.source, "version": __version__}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(src), "r": r_pad,
              "lora_alpha": r_pad, "target_modules": targets, "layers_to_transform": list(r.units), "bias": "none",
              "fan_in_fan_out": fold.transposed, "lora_dropout": 0.0, "use_rslora": False, "inference_mode": True,
              "rolemrc": provenance}
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata=provenance_metadata(src, fingerprint, r))
    return LoraReport(str(out), r_pad, max_units, targets, list(r.units), fingerprint, r.to_dict())
