"""Scoring: responses -> per-item metrics and verdicts -> aggregates with CIs, saved as a run folder.

A run folder holds `responses.jsonl` (id, task, question, reference, response, latency, tokens, fields),
`verdicts.jsonl`, `metrics.jsonl` (per-sample values) and the reports (`report.json`, `report.md`,
`chart.html`, `chart.png`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rolemrc.core.artifacts import GENERIC, KINDS, check_format, identify, stamp
from rolemrc.core.errors import RolemrcError
from rolemrc.core.io import read_input_jsonl, read_jsonl, write_jsonl
from rolemrc.core.records import merge_fields
from rolemrc.core.stats import mean_ci
from rolemrc.eval.aggregate import aggregate
from rolemrc.eval.judges import JudgeConfig, judge_info
from rolemrc.eval.judges import judge as run_judge
from rolemrc.eval.metrics import MetricConfig, compute

REQUIRED = ("id", "task", "reference", "response")


class RunError(RolemrcError, ValueError):
    """Responses or a run folder are not usable for scoring."""


@dataclass
class EvalRun:
    """A scored run: items (with responses), per-item metric values, verdicts and the summary."""

    items: list[dict[str, Any]]
    metrics: list[dict[str, Any]] = field(default_factory=list)    # {"id", <metric>: value, ...}
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    def save(self, out: str | os.PathLike, *, chart: bool = True) -> Path:
        """Write the run folder (JSONL files, report.json, report.md and, with `chart`, chart.html/png)."""
        from rolemrc.eval.report import run_markdown, write_chart

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        write_jsonl(out / "responses.jsonl", self.items)
        write_jsonl(out / "metrics.jsonl", self.metrics)
        write_jsonl(out / "verdicts.jsonl", self.verdicts)
        if chart:
            self.summary["chart"] = write_chart([(out.name or "run", self.summary)], out / "chart")
        report = {**stamp("eval-run"), **self.summary}   # the file says what it is
        (out / "report.json").write_text(json.dumps(report, indent=1, allow_nan=True))
        (out / "report.md").write_text(run_markdown(self.summary, out.name or "run"))
        self.path = out
        return out

    @classmethod
    def load(cls, path: str | os.PathLike) -> EvalRun:
        path = Path(path)
        if not (path / "report.json").is_file():
            found = identify(path)
            what = "no such folder" if found == "missing" else f"it is {KINDS[found]}, not a scored eval run (no report.json)"
            raise RunError(f"{path}: {what}; `rolemrc eval run` or `eval score` writes one")
        summary = json.loads((path / "report.json").read_text())
        check_format(path / "report.json", summary, "eval-run")
        summary = {k: v for k, v in summary.items() if k not in ("kind", "format")}
        return cls(read_jsonl(path / "responses.jsonl"), read_jsonl(path / "metrics.jsonl"),
                   read_jsonl(path / "verdicts.jsonl"), summary, path)

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary, "verdicts": self.verdicts, "metrics": self.metrics}


def check_items(items: list[dict[str, Any]]) -> None:
    seen: set[str] = set()
    for k, item in enumerate(items):
        missing = [f for f in REQUIRED if f not in item]
        if missing:
            raise RunError(f"response {k} (id {item.get('id')!r}) lacks {missing}")
        if item["id"] in seen:
            raise RunError(f"duplicate id {item['id']!r}")
        seen.add(item["id"])


def score(items: list[dict[str, Any]] | str | os.PathLike, judge: str | JudgeConfig = "rules",
          metrics: tuple[str, ...] | MetricConfig | Literal["all"] | None = "all", *,
          rounds: int = 2000, seed: int = 0, progress: bool = False) -> EvalRun:
    """Score responses: `items` are records with id, task, question, reference, response (or a path
    to a responses JSONL). `judge`: a judge name (eval.judges.JUDGES: "rules", "openai" which needs a
    JudgeConfig) or a JudgeConfig. `metrics`: "all" (every group in eval.metrics.METRICS), metric groups
    (bleu, rouge, ...), a MetricConfig, or None for none.
    Returns an EvalRun whose `summary` has metric means/std/CIs and judge aggregates with CIs."""
    judge_config = judge if isinstance(judge, JudgeConfig) else JudgeConfig(name=judge)
    if metrics == "all":
        metrics = MetricConfig()
    metric_config = metrics if isinstance(metrics, MetricConfig) or metrics is None else MetricConfig(groups=tuple(metrics))
    source = None
    if not isinstance(items, list):
        source, items = items, read_input_jsonl(items, "`eval score` wants responses (from `rolemrc eval generate`)",
                                                ("responses", *GENERIC))
    try:
        check_items(items)
    except RunError as exc:
        raise RunError(f"{source}: {exc}" if source else str(exc)) from None
    hyps = [str(item["response"] or "") for item in items]
    refs = [str(item["reference"] or "") for item in items]
    summary: dict[str, Any] = {"n_items": len(items), "judge": judge_info(judge_config), "bootstrap_rounds": rounds}
    if any("fields" in item for item in items):   # where generate found turns, reference and id
        summary["fields"] = merge_fields(item["fields"] for item in items if "fields" in item)
    per_item: list[dict[str, Any]] = [{"id": item["id"]} for item in items]
    if metric_config is not None and items:
        result = compute(hyps, refs, metric_config)
        summary["metrics"] = {name: mean_ci(vals, rounds=rounds, seed=seed) for name, vals in result.values.items()}
        for name, value in result.corpus.items():
            summary["metrics"][name]["corpus"] = value
        summary["metric_info"], summary["metrics_unavailable"] = result.info, result.unavailable
        for name, vals in result.values.items():
            for row, value in zip(per_item, vals):
                row[name] = value
    verdicts = [v.to_dict() for v in run_judge(items, judge_config, progress=progress)]
    summary["judge_aggregates"] = aggregate(verdicts, rounds=rounds, seed=seed)
    judged = {v["id"] for v in verdicts}
    summary["unjudged_tasks"] = sorted({str(i["task"]) for i in items if i["id"] not in judged})
    latencies = [i["latency"] for i in items if isinstance(i.get("latency"), (int, float)) and math.isfinite(i["latency"])]
    if latencies:
        summary["latency_s"] = mean_ci(latencies, rounds=rounds, seed=seed)
    return EvalRun(items, per_item, verdicts, summary)

