"""Stable hook point names (DESIGN.md "Probe") resolved on Llama/Qwen2/Mistral and GPT-2 layouts.

A hook point `layers.{i}.<point>` names a tensor of shape [batch, seq, width]. `site(model, point, i)`
returns where it lives: a module and whether the tensor is that module's output or its first input.
Collectors read sites; restraints (rolemrc.intervene) rewrite them through the same objects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

HOOK_POINTS: tuple[str, ...] = ("mlp.act", "mlp.post", "mlp.out", "attn.out", "resid.post")


class UnsupportedModelError(ValueError):
    """The model's module layout is not one the hook points know."""


@dataclass(frozen=True)
class Layout:
    """Where a family of architectures keeps its blocks and the modules inside each block."""

    name: str
    blocks: str  # dotted path from the causal-LM to the list of blocks
    act: str  # activation module inside the MLP (its output is act(gate) or act(fc))
    down: str  # the MLP's output projection (input = mlp.post)
    mlp: str
    attn: str
    gated: bool


LAYOUTS: tuple[Layout, ...] = (
    Layout("llama-like (Llama, Qwen2, Mistral)", "model.layers", "mlp.act_fn", "mlp.down_proj", "mlp", "self_attn", True),
    Layout("gpt2", "transformer.h", "mlp.act", "mlp.c_proj", "mlp", "attn", False),
)


def _get(root: nn.Module, dotted: str) -> Any:
    obj: Any = root
    for part in dotted.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def layout_of(model: nn.Module) -> Layout:
    """The layout of `model`, or an error naming the supported ones."""
    for layout in LAYOUTS:
        try:
            block = _get(model, layout.blocks)[0]
            _get(block, layout.act), _get(block, layout.down), _get(block, layout.attn)
        except (AttributeError, IndexError, TypeError):
            continue
        return layout
    supported = "; ".join(f"{l.name}: {l.blocks}[i].{{{l.act}, {l.down}, {l.attn}}}" for l in LAYOUTS)
    raise UnsupportedModelError(f"unsupported module layout for {type(model).__name__}; supported layouts: {supported}")


def num_layers(model: nn.Module) -> int:
    return len(_get(model, layout_of(model).blocks))


def check_point(point: str) -> str:
    if point not in HOOK_POINTS:
        raise ValueError(f"unknown hook point {point!r}; choose one of {', '.join(HOOK_POINTS)}")
    return point


@dataclass(frozen=True)
class Site:
    """The tensor of one hook point in one layer: a module's output, or its first positional input."""

    point: str
    layer: int
    module: nn.Module
    module_name: str  # dotted name inside the causal-LM (for nnsight and friends)
    is_input: bool

    def capture(self, fn: Callable[[torch.Tensor], None]) -> torch.utils.hooks.RemovableHandle:
        """Call fn(tensor) whenever the site is computed; the tensor is not modified."""
        if self.is_input:
            return self.module.register_forward_pre_hook(lambda _m, args: fn(args[0]))
        return self.module.register_forward_hook(lambda _m, _a, out: fn(_first(out)))

    def rewrite(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.utils.hooks.RemovableHandle:
        """Replace the site's tensor by fn(tensor) whenever it is computed."""
        if self.is_input:
            return self.module.register_forward_pre_hook(lambda _m, args: (fn(args[0]), *args[1:]))

        def hook(_m, _a, out):
            if isinstance(out, tuple):
                return (fn(out[0]), *out[1:])
            return fn(out)

        return self.module.register_forward_hook(hook)


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def site(model: nn.Module, point: str, layer: int) -> Site:
    """Resolve hook point `layers.{layer}.{point}` on `model`."""
    check_point(point)
    layout = layout_of(model)
    n = num_layers(model)
    if not 0 <= layer < n:
        raise ValueError(f"layer {layer} out of range: the model has {n} layers (0-{n - 1})")
    prefix = f"{layout.blocks}.{layer}"
    if point == "mlp.act":
        name, is_input = f"{prefix}.{layout.act}", False
    elif point == "mlp.post":
        name, is_input = f"{prefix}.{layout.down}", True
    elif point == "mlp.out":
        name, is_input = f"{prefix}.{layout.mlp}", False
    elif point == "attn.out":
        name, is_input = f"{prefix}.{layout.attn}", False
    else:
        name, is_input = prefix, False
    return Site(point, layer, _get(model, name), name, is_input)


def width(model: nn.Module, point: str) -> int:
    """Number of units at a hook point (intermediate size for mlp.act/post, hidden size otherwise)."""
    check_point(point)
    cfg = model.config
    hidden = getattr(cfg, "hidden_size", None) or cfg.n_embd
    if point in ("mlp.act", "mlp.post"):
        return getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * hidden
    return hidden
