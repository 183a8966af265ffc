"""The probe: top-k unit frequencies per RoleMRC dimension, and SFT-vs-DPO diffs.

    from rolemrc.probe import collect, diff
    sft = collect("runs/sft", "test.jsonl", hook="mlp.act")       # ProbeCounts
    dpo = collect("runs/dpo", "test.jsonl", hook="mlp.act")
    result = diff(sft, dpo)                                         # DiffResult (unpaired z-test)
    paired = collect_paired(["runs/sft", "runs/dpo"], "test.jsonl")  # PairedCounts: one pass, same cases
    result = diff(paired)                                           # exact McNemar per unit
    whole = merge(["part-0.safetensors", "part-1.safetensors"])     # shards of the cases, summed
    write_diff(result, "runs/diff")                                 # tables + heatmaps
"""

from rolemrc.probe.collect import CollectConfig, collect, collect_paired, collect_to_file
from rolemrc.probe.counts import ProbeCounts
from rolemrc.probe.diff import DiffResult, ProbeMismatchError, diff, load_diff
from rolemrc.probe.hooks import HOOK_POINTS, site
from rolemrc.probe.merge import merge
from rolemrc.probe.paired import PairedCounts, load_probe
from rolemrc.probe.report import write_diff

__all__ = [
    "HOOK_POINTS",
    "CollectConfig",
    "DiffResult",
    "PairedCounts",
    "ProbeCounts",
    "ProbeMismatchError",
    "collect",
    "collect_paired",
    "collect_to_file",
    "diff",
    "load_diff",
    "load_probe",
    "merge",
    "site",
    "write_diff",
]
