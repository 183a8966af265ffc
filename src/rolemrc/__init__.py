"""rolemrc: RoleMRC end to end, from data synthesis to probing, restraint and serving.

The method's verbs import from here (each loads torch on first use); on two tiny models standing in for an SFT and a
DPO checkpoint (directories or loaded models alike):

    >>> import tempfile
    >>> import rolemrc
    >>> from rolemrc.core.tiny import example_models
    >>> sft, dpo = example_models(tempfile.mkdtemp())
    >>> result = rolemrc.diff(rolemrc.collect_paired([sft, dpo], ["Who keeps the lighthouse?", "Sing to the ovens."] * 4))
    >>> spec = rolemrc.select(result, result.largest_shift(), method="standardized", per_layer=4, factor=0.0)
    >>> rolemrc.check(dpo, spec, prompts=["Who keeps the lighthouse?"]).numerical_noop
    False

`rolemrc.bake` and `rolemrc.export_lora` write the restraint into weights or an exact PEFT LoRA adapter;
`rolemrc.applied(model, spec)` hooks it at run time; docs/python.md walks through every verb. Everything else lives
in its package (`rolemrc.probe`, `rolemrc.intervene`, `rolemrc.eval`, `rolemrc.serve`, ...).
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
