"""Hook points, the model anatomy probe and intervene both stand on (docs/ARCHITECTURE.md "Hook points"): one table row
each, resolved on Llama/Qwen2/Mistral and GPT-2 layouts.

A hook point `layers.{i}.<point>` names a tensor of shape [batch, seq, width]. Everything that knows
about a hook point reads its `HookPoint` row in `HOOK_POINTS`: `site()` (where the tensor lives),
`width()`, the collector backends (TransformerBridge names), bake (which weight absorbs a restraint)
and the CLI help. Adding a hook point is adding a row (and, for a new module, a role in each `Layout`).
The module imports no torch: it only walks a model's attributes and registers hooks on its modules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from rolemrc.core.errors import RolemrcError

if TYPE_CHECKING:
    import torch
    from torch import nn


class HookError(RolemrcError, ValueError):
    """An unknown hook point, or a layer the model does not have."""


class UnsupportedModelError(HookError):
    """The model's module layout is not one the hook points know."""


@dataclass(frozen=True)
class Layout:
    """Where a family of architectures keeps its blocks, and each module role's path inside a block."""

    name: str
    blocks: str  # dotted path from the causal-LM to the list of blocks
    modules: Mapping[str, str]  # role -> dotted path inside a block ("" = the block itself)


LAYOUTS: tuple[Layout, ...] = (
    Layout("llama-like (Llama, Qwen2, Mistral)", "model.layers", {
        "act": "mlp.act_fn", "down": "mlp.down_proj", "mlp": "mlp", "attn": "self_attn",
        "attn_proj": "self_attn.o_proj", "block": ""}),
    Layout("gpt2", "transformer.h", {
        "act": "mlp.act", "down": "mlp.c_proj", "mlp": "mlp", "attn": "attn", "attn_proj": "attn.c_proj",
        "block": ""}),
)


def _hidden(cfg: Any) -> int:
    return getattr(cfg, "hidden_size", None) or cfg.n_embd


def _intermediate(cfg: Any) -> int:
    return getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * _hidden(cfg)


WIDTHS: dict[str, Callable[[Any], int]] = {"hidden": _hidden, "intermediate": _intermediate}  # from model.config


@dataclass(frozen=True)
class WeightFold:
    """How a restraint folds exactly into a projection: scale its input units (weight columns) or its
    output units (weight rows and the bias)."""

    weight: str  # layout role of the projection
    side: Literal["in", "out"]


@dataclass(frozen=True)
class HookPoint:
    """One hook point: where its tensor lives, its width, its TransformerBridge name, how it bakes."""

    name: str
    tensor: str  # what the tensor is (documentation)
    module: str  # layout role of the module whose output (or first input) the tensor is
    is_input: bool
    width: Literal["hidden", "intermediate"]  # a key of WIDTHS
    bridge: str | None  # TransformerBridge hook name (`{i}` = layer); None: not on the bridge
    bridge_then: str | None = None  # layout role of a module applied to the bridge tensor to give this one
    fold: WeightFold | None = None  # None: cannot be baked into weights exactly
    no_fold: str = ""  # why it cannot
    lora: bool = False  # its fold can ship as a LoRA adapter (where the fold scales no bias)


HOOK_POINTS: dict[str, HookPoint] = {p.name: p for p in (
    # mlp.act has no bridge hook of its own: the layout's activation module applied to `mlp.hook_pre`
    # (the gate projection's output on gated MLPs)
    HookPoint("mlp.act", 'act(gate), before the product with up (the "neurons")', "act", False, "intermediate",
              "blocks.{i}.mlp.hook_pre", bridge_then="act", fold=WeightFold("down", "in"), lora=True),
    HookPoint("mlp.post", "input of the down projection (act(gate) * up; = mlp.act on GPT-2)", "down", True,
              "intermediate", "blocks.{i}.mlp.hook_post", fold=WeightFold("down", "in"), lora=True),
    HookPoint("mlp.out", "MLP output (what the RoleMRC code hooked on Llama)", "mlp", False, "hidden",
              "blocks.{i}.hook_mlp_out", fold=WeightFold("down", "out"), lora=True),
    HookPoint("attn.out", "attention output (what it hooked on Qwen)", "attn", False, "hidden",
              "blocks.{i}.hook_attn_out", fold=WeightFold("attn_proj", "out"), lora=True),
    HookPoint("resid.post", "residual stream after the block", "block", False, "hidden",
              "blocks.{i}.hook_resid_post",
              no_fold="the residual stream after a block feeds the next block's norm and the skip connection"),
)}


def _get(root: nn.Module, dotted: str) -> Any:
    obj: Any = root
    for part in filter(None, dotted.split(".")):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def layout_of(model: nn.Module) -> Layout:
    """The layout of `model` (every module role found in its first block), or an error naming the supported ones."""
    for layout in LAYOUTS:
        try:
            block = _get(model, layout.blocks)[0]
            for path in layout.modules.values():
                _get(block, path)
        except (AttributeError, IndexError, TypeError):
            continue
        return layout
    supported = "; ".join(f"{l.name}: {l.blocks}[i].{{{', '.join(filter(None, l.modules.values()))}}}"
                          for l in LAYOUTS)
    raise UnsupportedModelError(f"unsupported module layout for {type(model).__name__}; supported layouts: {supported}")


def num_layers(model: nn.Module) -> int:
    return len(_get(model, layout_of(model).blocks))


def hook_point(point: str) -> HookPoint:
    """The table row of `point`, or a HookError listing the known ones."""
    if point not in HOOK_POINTS:
        raise HookError(f"unknown hook point {point!r}; choose one of {', '.join(HOOK_POINTS)}")
    return HOOK_POINTS[point]


def check_point(point: str) -> str:
    return hook_point(point).name


def module_at(model: nn.Module, role: str, layer: int) -> tuple[str, nn.Module]:
    """(dotted name inside the causal-LM, module) of a layout role in block `layer`."""
    layout = layout_of(model)
    n = len(_get(model, layout.blocks))
    if not 0 <= layer < n:
        raise HookError(f"layer {layer} out of range: the model has {n} layers (0-{n - 1})")
    if role not in layout.modules:
        raise UnsupportedModelError(f"the {layout.name} layout has no {role!r} module")
    name = ".".join(filter(None, (layout.blocks, str(layer), layout.modules[role])))
    return name, _get(model, name)


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
    row = hook_point(point)
    name, module = module_at(model, row.module, layer)
    return Site(point, layer, module, name, row.is_input)


def width(model: nn.Module, point: str) -> int:
    """Number of units at a hook point (its row says which config size: intermediate or hidden)."""
    return WIDTHS[hook_point(point).width](model.config)


def hook_table_markdown() -> str:
    """The hook point table as Markdown (docs/probe.md's table is this function's output)."""
    def where(row: HookPoint, layout: Layout) -> str:
        if row.module not in layout.modules:
            return "-"
        path = layout.modules[row.module]
        return f"{'input' if row.is_input else 'output'} of " + (f"`{path}`" if path else "the block")

    def bridge(row: HookPoint) -> str:
        if row.bridge is None:
            return "-"
        return f"{row.bridge_then}(`{row.bridge}`)" if row.bridge_then else f"`{row.bridge}`"

    def bake(row: HookPoint) -> str:
        if row.fold is None:
            return "no (runtime hook only)"
        paths = " / ".join(f"`{l.modules[row.fold.weight]}`" for l in LAYOUTS if row.fold.weight in l.modules)
        return f"{'input' if row.fold.side == 'in' else 'output'} units of {paths}"

    def lora(row: HookPoint) -> str:
        if not (row.lora and row.fold):
            return "no"
        return "yes" if row.fold.side == "in" else "yes, unless the projection has a bias (as on GPT-2)"

    head = ["hook point", "tensor", "width", *(l.name for l in LAYOUTS), "TransformerLens", "bake", "LoRA"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in HOOK_POINTS.values():
        cells = [f"`layers.{{i}}.{row.name}`", row.tensor, row.width, *(where(row, l) for l in LAYOUTS),
                 bridge(row), bake(row), lora(row)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
