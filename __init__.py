"""rolemrc: RoleMRC end to end, from data synthesis to probing, restraint and serving.

The method's verbs, importable from here (each loads torch on first use):

    import rolemrc
    paired = rolemrc.collect_paired(["runs/sft", "runs/dpo"], ["Who keeps the lighthouse?", ...])  # or a JSONL path
    result = rolemrc.diff(paired)                   # DiffResult: per-unit frequency shifts, exact McNemar
    result.largest_shift()                          # the dimension whose units moved most
    spec = rolemrc.select(result, result.largest_shift(), top_k=64)   # a Restraint
    with rolemrc.applied(model, spec): ...          # runtime hooks on a loaded model
    rolemrc.bake("runs/dpo", spec, "runs/dpo-restrained")             # the same scaling in the weights
    rolemrc.export_lora("runs/dpo", spec, "runs/dpo-restrained-lora")   # ... or as an exact PEFT LoRA adapter

Everything else lives in its package (`rolemrc.probe`, `rolemrc.intervene`, `rolemrc.eval`, `rolemrc.serve`, ...).
"""

from rolemrc.core.lazy import lazy_package
from rolemrc.core.version import __version__

lazy_package(__name__, {
    "rolemrc.probe.collect": ["collect", "collect_paired"],
    "rolemrc.probe.attribution": ["attribute"],
    "rolemrc.probe.diff": ["DiffResult", "diff", "load_diff"],
    "rolemrc.probe.report": ["write_diff"],
    "rolemrc.probe.explorer": ["write_explorer"],
    "rolemrc.intervene.spec": ["Restraint"],
    "rolemrc.intervene.select": ["select"],
    "rolemrc.intervene.runtime": ["applied"],
    "rolemrc.intervene.bake": ["bake"],
    "rolemrc.intervene.check": ["check"],
    "rolemrc.intervene.lora": ["export_lora"],
})

__all__ = ["DiffResult", "Restraint", "__version__", "applied", "attribute", "bake", "check", "collect",
           "collect_paired", "diff", "export_lora", "load_diff", "select", "write_diff", "write_explorer"]
