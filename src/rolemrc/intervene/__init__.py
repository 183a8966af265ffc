"""Restraints: scale the units a diff singled out, as a runtime hook or baked into weights.

    from transformers import AutoModelForCausalLM
    from rolemrc.intervene import Restraint, applied, bake, check, export_lora, select
    from rolemrc.probe import load_diff
    r = select("runs/attribution.safetensors", "multi_turn", method="attribution", share=0.17, factor=0)
    r = select("runs/diff", "multi_turn", method="standardized", per_layer=16, layers="1-3", factor=0)
    r = select(load_diff("runs/diff"), "multi_turn", method="standardized", top_k=64, factor=0.5)   # a DiffResult
    r = select("runs/diff", "multi_turn", calibration="runs/calibration")   # the calibration's recommendation
    model = AutoModelForCausalLM.from_pretrained("runs/dpo")
    with applied(model, r): ...                                         # runtime hooks
    bake("runs/dpo", r, "runs/dpo-restrained")                          # the same scaling in the weights
    export_lora(model, r, "runs/dpo-restrained-lora")                   # ... or as an exact LoRA adapter
    check(model, r, baked_dir="runs/dpo-restrained").verdict            # agreement and no-op detection

The spec (plain data) imports no torch; the rest is imported on first use (`core.lazy`).
"""

from rolemrc.core.lazy import lazy_package
from rolemrc.intervene.spec import Restraint, RestraintError, parse_layers

lazy_package(__name__, {
    "rolemrc.intervene.bake": ["BakeReport", "bake"],
    "rolemrc.intervene.check": ["CheckReport", "check"],
    "rolemrc.intervene.lora": ["LoraReport", "export_lora"],
    "rolemrc.intervene.runtime": ["applied"],
    "rolemrc.intervene.select": ["select"],
    "rolemrc.probe.selectors": ["SELECTORS"],
})

__all__ = ["SELECTORS", "BakeReport", "CheckReport", "LoraReport", "Restraint", "RestraintError", "applied", "bake", "check",
           "export_lora", "parse_layers", "select"]
