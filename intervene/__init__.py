"""Restraints: scale the units a diff singled out, as a runtime hook or baked into weights.

    from rolemrc.intervene import Restraint, applied, bake, check, select
    r = select("runs/diff", "multi_turn", layers="1-3", top_k=64)      # or Restraint.load("spec.yaml")
    with r.applied(model): ...                                          # runtime hooks
    bake("runs/dpo", r, "runs/dpo-restrained")                          # the same scaling in the weights
    export_lora("runs/dpo", r, "runs/dpo-restrained-lora")              # ... or as an exact LoRA adapter
    check("runs/dpo", r, baked_dir="runs/dpo-restrained").verdict       # agreement and no-op detection
"""

from rolemrc.intervene.bake import BakeReport, bake
from rolemrc.intervene.check import CheckReport, check
from rolemrc.intervene.lora import LoraReport, export_lora
from rolemrc.intervene.runtime import applied
from rolemrc.intervene.select import select
from rolemrc.intervene.spec import Restraint, RestraintError, parse_layers

__all__ = ["BakeReport", "CheckReport", "LoraReport", "Restraint", "RestraintError", "applied", "bake", "check",
           "export_lora", "parse_layers", "select"]
