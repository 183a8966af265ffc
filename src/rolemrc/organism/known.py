"""The units organism: a DPO update that reaches the model only through a known set S of MLP units, so a selector's
ranking can be scored unit by unit (detection.py).

S is `known_units` units in each of `known_layers` layers, drawn with the seed; a unit is one intermediate unit of a
block's MLP (hook points mlp.act and mlp.post), and its parameters are its slice of every MLP weight with an axis of
the intermediate width (Llama: its rows of gate_proj and up_proj and its column of down_proj; GPT-2: its column and
bias of c_fc and its row of c_proj). DPO trains only those slices (`UnitMask`: everything else frozen, the masked
weights' gradients multiplied by a 0/1 mask; AdamW with weight decay 0 leaves a parameter whose gradient is zero
exactly as it was), so the DPO model equals the SFT model outside S, and reverting S's slices to the SFT model's
gives the SFT model back, weight for weight (`carrier_check` asserts both and measures what the held-out prompts see).
"""

from __future__ import annotations

import copy
import random
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback

from rolemrc.core.hooks import WIDTHS, module_at
from rolemrc.organism.config import OrganismError

if TYPE_CHECKING:
    from torch import nn

Units = dict[int, list[int]]   # layer -> unit indices at the MLP's intermediate width
CONTROLS = 3   # random unit sets of S's size reverted beside S


def choose_units(layers: int, width: int, known_layers: int, per_layer: int, seed: int) -> Units:
    """`per_layer` units in each of `known_layers` layers of a model with `layers` blocks of `width` MLP units."""
    if known_layers > layers or per_layer > width:
        raise OrganismError(f"known_layers {known_layers} x known_units {per_layer} do not fit a model of {layers} "
                            f"layers x {width} MLP units")
    rng = random.Random(seed)
    return {layer: sorted(rng.sample(range(width), per_layer)) for layer in sorted(rng.sample(range(layers), known_layers))}


def random_units(known: Units, width: int, seed: int) -> Units:
    """As many units as `known` in each of its layers, drawn at random (they may overlap it)."""
    rng = random.Random(seed)
    return {layer: sorted(rng.sample(range(width), len(units))) for layer, units in known.items()}


def units_json(units: Units) -> dict[str, list[int]]:
    """S as known_units.json and organism.json keep it (JSON keys are strings)."""
    return {str(layer): list(units[layer]) for layer in sorted(units)}


def model_shape(model_or_config: Any) -> tuple[int, int]:
    """(blocks, MLP intermediate width) of a model or its config."""
    config = getattr(model_or_config, "config", model_or_config)
    return int(config.num_hidden_layers), int(WIDTHS["intermediate"](config))


def unit_slices(model: nn.Module, units: Units) -> dict[str, tuple[nn.Parameter, int, torch.Tensor]]:
    """Parameter name -> (parameter, its unit axis, bool mask of S's slices) for every parameter of a known layer's
    MLP with an axis of the intermediate width (refused where two axes have it: which one is the unit's?)."""
    _, width = model_shape(model)
    out = {}
    for layer, units_ in units.items():
        name, mlp = module_at(model, "mlp", layer)
        index = torch.tensor(units_, dtype=torch.long)
        for sub, param in mlp.named_parameters():
            axes = [k for k, n in enumerate(param.shape) if n == width]
            if len(axes) > 1:
                raise OrganismError(f"{name}.{sub} has {len(axes)} axes of the MLP width {width}: cannot tell its "
                                    "unit axis (a model whose hidden size equals its MLP width)")
            if axes:
                mask = torch.zeros(param.shape[axes[0]], dtype=torch.bool)
                mask[index] = True
                shape = [1] * param.dim()
                shape[axes[0]] = -1
                out[f"{name}.{sub}"] = (param, axes[0], mask.reshape(shape).expand_as(param))
    return out


class UnitMask(TrainerCallback):
    """At the start of training: freeze every parameter but the known layers' MLP weights with a unit axis, and make
    their gradients zero outside S's slices. Refuses weight decay (it would move the frozen slices)."""

    def __init__(self, units: Units):
        self.units = units

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if args.weight_decay != 0:
            raise OrganismError(f"the units organism trains with weight_decay 0 (got {args.weight_decay}): decay "
                                "would move the weights outside the known units")
        slices = unit_slices(model, self.units)
        for param in model.parameters():
            param.requires_grad_(False)
        for param, _, mask in slices.values():
            param.requires_grad_(True)
            keep = mask.to(param.dtype)
            param.register_hook(lambda grad, keep=keep: grad * keep.to(grad.device))


def revert_units(model: nn.Module, sft: nn.Module, units: Units) -> nn.Module:
    """A copy of `model` with the slices of `units` set to the SFT model's."""
    out = copy.deepcopy(model)
    theirs = dict(sft.named_parameters())
    with torch.no_grad():
        for name, (param, _, mask) in unit_slices(out, units).items():
            param[mask] = theirs[name].to(param.dtype)[mask]
    return out


def changed_outside(model: nn.Module, sft: nn.Module, units: Units) -> list[str]:
    """Parameters of `model` that differ from the SFT model's anywhere outside the slices of `units` (exactly: the
    SFT weights cast to the model's dtype)."""
    masks = {name: mask for name, (_, _, mask) in unit_slices(model, units).items()}
    theirs = dict(sft.named_parameters())
    differ = []
    for name, param in model.named_parameters():
        other = theirs[name].to(param.dtype)
        same = param == other
        if name in masks:
            same |= masks[name]
        if not bool(same.all()):
            differ.append(name)
    return differ
