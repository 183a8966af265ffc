"""The probe: top-k unit frequencies per RoleMRC dimension, and SFT-vs-DPO diffs.

    from rolemrc.probe import collect, diff
    sft = collect("runs/sft", "test.jsonl", hook="mlp.act")       # ProbeCounts
    dpo = collect("runs/dpo", "test.jsonl", hook="mlp.act")
    result = diff(sft, dpo)                                         # DiffResult
    write_diff(result, "runs/diff")                                 # tables + heatmaps
"""

from rolemrc.probe.collect import CollectConfig, collect, collect_to_file
from rolemrc.probe.counts import ProbeCounts
from rolemrc.probe.diff import DiffResult, ProbeMismatchError, diff, load_diff
from rolemrc.probe.hooks import HOOK_POINTS, site
from rolemrc.probe.report import write_diff

__all__ = [
    "HOOK_POINTS",
    "CollectConfig",
    "DiffResult",
    "ProbeCounts",
    "ProbeMismatchError",
    "collect",
    "collect_to_file",
    "diff",
    "load_diff",
    "site",
    "write_diff",
]
