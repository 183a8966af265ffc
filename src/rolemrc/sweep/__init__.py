"""Restraint sweeps: a grid of restraints (dimension x budget x factor) generated and scored against one unrestrained
baseline and seeded random-unit controls, paired per item and Holm-corrected over the grid (`rolemrc.ab` serves the
best cells as the arms of an A/B experiment).

    from rolemrc.sweep import SweepConfig, run_sweep
    summary = run_sweep(SweepConfig(model="runs/dpo", diff="runs/diff", data="runs/data/test.jsonl",
                                    out="runs/sweep", dimensions=["multi_turn"], method="attribution",
                                    factors=[0.5, 0.0], share=[0.01, 0.17]))
    summary["headline"]

It sits above eval (scoring) and serve (a vLLM-backed `rolemrc serve` as an engine):
plan -> sources -> run -> stats -> report, plots.
"""

from rolemrc.sweep.plan import SweepConfig
from rolemrc.sweep.run import run_sweep

__all__ = ["SweepConfig", "run_sweep"]
