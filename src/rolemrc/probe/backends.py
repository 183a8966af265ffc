"""Collector backends: they run one padded batch and feed each layer's hook-point tensor to a counter.

- `torch`: plain forward hooks on the HF modules (default; skips the LM head).
- `nnsight`: the same modules traced with nnsight's LanguageModel.
- `transformer-lens`: TransformerLens 4's TransformerBridge with its stable `blocks.{i}.*` hook names
  (each hook point's row in `HOOK_POINTS` names its bridge hook).
All three read the same tensors, so on the same model they give identical counts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, get_args

import torch
from torch import nn

from rolemrc.core.hooks import hook_point, module_at, num_layers, site
from rolemrc.probe.errors import ProbeError, check_choice
from rolemrc.probe.options import Backend

BACKENDS: tuple[str, ...] = get_args(Backend)

Sink = Callable[[int, torch.Tensor], None]  # (layer, activations [batch, seq, width])


class TorchBackend:
    """Forward hooks on each layer's site; runs the base model only (no logits needed)."""

    def __init__(self, model: nn.Module, point: str, tokenizer: Any = None):
        self.model, self.point = model, point
        self.sites = [site(model, point, i) for i in range(num_layers(model))]

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, sink: Sink) -> None:
        handles = [s.capture(lambda t, i=s.layer: sink(i, t)) for s in self.sites]
        try:
            self.model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        finally:
            for h in handles:
                h.remove()


class NNsightBackend:
    """nnsight tracing of the same modules (saved per layer, then counted)."""

    def __init__(self, model: nn.Module, point: str, tokenizer: Any = None):
        from nnsight import LanguageModel

        self.lm = LanguageModel(model, tokenizer=tokenizer)
        self.sites = [site(model, point, i) for i in range(num_layers(model))]

    def _envoy(self, dotted: str):
        envoy = self.lm
        for part in dotted.split("."):
            envoy = envoy[int(part)] if part.isdigit() else getattr(envoy, part)
        return envoy

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, sink: Sink) -> None:
        saved = []
        with self.lm.trace({"input_ids": input_ids, "attention_mask": attention_mask}):
            for s in self.sites:  # in execution order, as nnsight requires
                envoy = self._envoy(s.module_name)
                saved.append((envoy.input if s.is_input else envoy.output).save())
        for s, value in zip(self.sites, saved):
            sink(s.layer, value[0] if isinstance(value, tuple) else value)


class TransformerLensBackend:
    """TransformerLens TransformerBridge over the same HF model, hooks streamed via run_with_hooks.

    Note: booting the bridge switches the HF model to eager attention (in place).
    """

    def __init__(self, model: nn.Module, point: str, tokenizer: Any = None):
        row = hook_point(point)
        if row.bridge is None:
            raise ProbeError(f"{point} has no TransformerBridge hook; use the torch or nnsight backend")
        from transformer_lens.model_bridge import TransformerBridge

        source = getattr(model.config, "_name_or_path", "") or getattr(tokenizer, "name_or_path", "")
        if not source:
            raise ProbeError("the transformer-lens backend needs a model loaded from a local directory")
        device = next(model.parameters()).device
        self.bridge = TransformerBridge.boot_transformers(source, hf_model=model, tokenizer=tokenizer, device=device,
                                                          dtype=next(model.parameters()).dtype)
        self.hooks = []  # (bridge hook name, layer, bridge tensor -> our tensor)
        for i in range(num_layers(model)):
            then = module_at(model, row.bridge_then, i)[1] if row.bridge_then else (lambda t: t)
            self.hooks.append((row.bridge.format(i=i), i, then))

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, sink: Sink) -> None:
        fwd_hooks = [(name, lambda t, hook, i=i, f=f: sink(i, f(t))) for name, i, f in self.hooks]
        self.bridge.run_with_hooks(input_ids, fwd_hooks=fwd_hooks, attention_mask=attention_mask, return_type=None)


def make_backend(name: Backend, model: nn.Module, point: str, tokenizer: Any = None):
    classes = {"torch": TorchBackend, "nnsight": NNsightBackend, "transformer-lens": TransformerLensBackend}
    check_choice("backend", name, BACKENDS)
    return classes[name](model, point, tokenizer)
