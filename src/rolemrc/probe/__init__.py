"""The probe: top-k unit frequencies per RoleMRC dimension, and SFT-vs-DPO diffs.

    from rolemrc.probe import attribute, collect, collect_paired, diff, merge, write_diff
    sft = collect("runs/sft", "test.jsonl", hook="mlp.act")       # ProbeCounts
    dpo = collect("runs/dpo", "test.jsonl", hook="mlp.act")
    result = diff(sft, dpo)                                         # DiffResult (unpaired z-test)
    paired = collect_paired(["runs/sft", "runs/dpo"], "test.jsonl")  # PairedCounts: one pass, same cases
    result = diff(paired)                                           # exact McNemar per unit
    whole = merge(["part-0.safetensors", "part-1.safetensors"])     # shards of the cases, summed
    scores = attribute(["runs/sft", "runs/dpo"], "pairs.jsonl")     # Attribution: margin gradient x activation change
    write_diff(result, "runs/diff")                                 # tables + heatmaps

The hook table imports no torch; the rest is imported on first use (`core.lazy`).
"""

from rolemrc.core.hooks import HOOK_POINTS, site
from rolemrc.core.lazy import lazy_package

lazy_package(__name__, {
    "rolemrc.probe.attribution": ["AttributeConfig", "Attribution", "attribute", "attribute_to_file", "load_attribution"],
    "rolemrc.probe.collect": ["CollectConfig", "collect", "collect_paired", "collect_to_file"],
    "rolemrc.probe.counts": ["ProbeCounts"],
    "rolemrc.probe.diff": ["DiffResult", "ProbeMismatchError", "diff", "load_diff"],
    "rolemrc.probe.merge": ["merge"],
    "rolemrc.probe.paired": ["PairedCounts", "load_probe"],
    "rolemrc.probe.report": ["write_diff"],
})

__all__ = [
    "HOOK_POINTS",
    "AttributeConfig",
    "Attribution",
    "CollectConfig",
    "DiffResult",
    "PairedCounts",
    "ProbeCounts",
    "ProbeMismatchError",
    "attribute",
    "attribute_to_file",
    "collect",
    "collect_paired",
    "collect_to_file",
    "diff",
    "load_attribution",
    "load_diff",
    "load_probe",
    "merge",
    "site",
    "write_diff",
]
