"""Evaluation: generate responses, score them (reference metrics + five-aspect judge, bootstrap CIs),
compare runs (exact McNemar, paired bootstrap).

    from rolemrc.eval import generate, score, compare
    items = generate("runs/data/test.jsonl", model="runs/dpo")            # or base_url=..., model="dpo"
    run = score(items, judge="rules", metrics=("bleu", "rouge"))          # EvalRun; run.summary, run.verdicts
    run.save("runs/eval/dpo")
    result = compare("runs/eval/sft", "runs/eval/dpo")                    # Comparison; .verdicts, .metrics
"""

from rolemrc.eval.compare import Comparison, compare
from rolemrc.eval.generate import GenerateConfig, GenerationError, generate
from rolemrc.eval.judges import JudgeConfig, judge
from rolemrc.eval.metrics import MetricConfig
from rolemrc.eval.runs import EvalRun, RunError, score
from rolemrc.eval.verdicts import Verdict, parse_verdict

__all__ = ["Comparison", "EvalRun", "GenerateConfig", "GenerationError", "JudgeConfig", "MetricConfig", "RunError", "Verdict", "compare", "generate", "judge",
           "parse_verdict", "score"]
