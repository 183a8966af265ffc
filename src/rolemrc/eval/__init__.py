"""Evaluation: generate responses, score them (reference metrics + five-aspect judge, bootstrap CIs),
compare runs (exact McNemar on verdicts; paired bootstrap CI + sign-flip permutation p on metrics).

    from rolemrc.eval import generate, score, compare
    items = generate("runs/data/test.jsonl", model="runs/dpo")            # or base_url=..., model="dpo"
    run = score(items, judge="rules", metrics=("bleu", "rouge"))          # EvalRun; run.summary, run.verdicts
    run.save("runs/eval/dpo")
    result = compare("runs/eval/sft", "runs/eval/dpo")                    # Comparison; .verdicts, .metrics

A new metric group or judge is one decorated function: `@metric("name", scale=100.0, higher_is_better=True)`
(fn(hyps, refs, config) -> Scores) or `@register_judge("name")` (fn(calls, config, progress) -> list[Verdict]);
CLIs and reports read METRICS and JUDGES.
"""

from rolemrc.core.lazy import lazy_package
from rolemrc.eval.metrics import METRICS, MetricConfig, Scores, metric
from rolemrc.eval.verdicts import Verdict, parse_verdict

lazy_package(__name__, {   # numpy (aggregates, statistics) and tqdm on first use: the CLI's help needs neither
    "rolemrc.eval.compare": ["Comparison", "compare"],
    "rolemrc.eval.generate": ["GenerateConfig", "GenerationError", "generate"],
    "rolemrc.eval.judges": ["JUDGES", "JudgeConfig", "judge", "register_judge"],
    "rolemrc.eval.runs": ["EvalRun", "RunError", "score"],
})

__all__ = ["JUDGES", "METRICS", "Comparison", "EvalRun", "GenerateConfig", "GenerationError", "JudgeConfig",
           "MetricConfig", "RunError", "Scores", "Verdict", "compare", "generate", "judge", "metric", "parse_verdict",
           "register_judge", "score"]
