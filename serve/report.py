"""A/B report: per-arm scores from the eval module (rules/openai judge, reference metrics) with
bootstrap CIs, operational stats (latency, tokens), and unpaired tests of each arm against the first."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from rolemrc.eval.stats import mean_ci
from rolemrc.serve.stats import welch
from rolemrc.serve.store import Store

OPERATIONAL = ("latency_s", "completion_tokens", "response_chars")


def _items(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Eval items from logged chat requests whose metadata carries a task and/or a reference."""
    items = []
    for row in rows:
        meta = row.get("metadata") or {}
        if row["endpoint"] != "chat" or not ({"task", "reference"} & set(meta)):
            continue
        items.append({"id": row["id"], "task": str(meta.get("task") or ""), "question": row["messages"],
                      "reference": str(meta.get("reference") or ""), "response": row["response"],
                      "latency": row["latency_s"]})
    return items


def score_arm(rows: list[dict[str, Any]], judge: str, metrics: tuple[str, ...], rounds: int) -> tuple[dict, dict]:
    """(summary, per-item values for tests) of one arm's logged requests."""
    from rolemrc.eval import score
    from rolemrc.eval.metrics import MetricConfig, compute

    values: dict[str, list[float]] = {
        "latency_s": [r["latency_s"] for r in rows],
        "completion_tokens": [float(r["completion_tokens"]) for r in rows],
        "response_chars": [float(len(r["response"])) for r in rows]}
    summary: dict[str, Any] = {"n": len(rows), **{k: mean_ci(v, rounds=rounds) for k, v in values.items()},
                               "finish_length_rate": (sum(r["finish_reason"] == "length" for r in rows) / len(rows)
                                                      if rows else math.nan)}
    items = _items(rows)
    referenced = [i for i in items if i["reference"]]
    summary["with_reference"], summary["with_task"] = len(referenced), sum(bool(i["task"]) for i in items)
    if referenced and metrics:
        result = compute([i["response"] for i in referenced], [i["reference"] for i in referenced],
                         MetricConfig(groups=metrics))
        summary["metrics"] = {k: mean_ci(v, rounds=rounds) for k, v in result.values.items()}
        summary["metrics_unavailable"] = result.unavailable
        values |= {f"metric:{k}": v for k, v in result.values.items()}
    if items:
        run = score(items, judge=judge, metrics=None, rounds=rounds)
        per_response: dict[str, list[int]] = {}
        for v in run.verdicts:
            if v.get("score") is not None:
                per_response.setdefault(v["id"], []).append(v["score"])
        # the unit of analysis is the response (one request): a response's score is the mean of its judge
        # calls, so responses judged on several aspects do not count as several independent samples
        values["judge_score"] = [sum(s) / len(s) for s in per_response.values()]
        agg = run.summary["judge_aggregates"]
        summary["judge"] = {"name": judge, "calls": agg["calls"], "scored": agg["scored"],
                            "responses_scored": len(per_response),
                            "response_score": mean_ci(values["judge_score"], rounds=rounds),
                            "averages": agg.get("averages", {}), "dimensions": agg.get("dimensions", {})}
    return summary, values


def build_report(store: Store, exp_id: str, *, judge: str = "rules", metrics: tuple[str, ...] = ("bleu", "rouge"),
                 rounds: int = 2000, out_dir: str | Path | None = None) -> dict[str, Any]:
    """The report dict; with `out_dir`, also report.json, chart.html and chart.png there."""
    exp = store.experiment(exp_id)
    if exp is None:
        raise KeyError(f"no experiment {exp_id!r}")
    rows = store.requests(exp_id)
    arms: dict[str, Any] = {}
    per_item: dict[str, dict[str, list[float]]] = {}
    for arm in exp["arms"]:
        summary, values = score_arm([r for r in rows if r["arm"] == arm["name"]], judge, metrics, rounds)
        arms[arm["name"]] = {"model": arm["model"], "restraint": arm.get("restraint"), "weight": arm["weight"],
                             **summary}
        per_item[arm["name"]] = values
    names = list(arms)
    control = names[0]
    tests: dict[str, dict[str, Any]] = {}
    for name in names[1:]:
        t: dict[str, Any] = {}
        for key in per_item[control].keys() & per_item[name].keys():
            t[key] = welch(per_item[control][key], per_item[name][key], rounds=rounds)
        tests[f"{name} vs {control}"] = t
    report = {"experiment": exp_id, "description": exp["description"], "requests": len(rows), "control": control,
              "arms": arms, "tests": tests, "notes": notes(arms)}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        report["files"] = write_figure(report, out / "chart")
        (out / "report.json").write_text(json.dumps(report, indent=1, allow_nan=True))
    return _finite(report)


def notes(arms: dict[str, Any]) -> list[str]:
    """What could not be computed, and why."""
    out = []
    for name, arm in arms.items():
        if arm["n"] == 0:
            out.append(f"arm {name!r} has no logged requests")
        elif not arm["with_reference"]:
            out.append(f"arm {name!r}: no request carried metadata.reference, so no reference metrics")
        if arm["n"] and not arm["with_task"]:
            out.append(f"arm {name!r}: no request carried metadata.task, so no judge scores "
                       "(latency, token and length statistics only)")
    return out


def figure(report: dict[str, Any]):
    """Bars per arm with 95% CI error bars: judge pass rate, reference metrics, latency, tokens."""
    from plotly.subplots import make_subplots

    panels = [("judge score per response", lambda a: (a.get("judge") or {}).get("response_score")),
              *[(f"metric {k}", lambda a, k=k: (a.get("metrics") or {}).get(k))
                for k in sorted({k for a in report["arms"].values() for k in (a.get("metrics") or {})})],
              *[(k, lambda a, k=k: a.get(k)) for k in OPERATIONAL]]
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[t for t, _ in panels])
    for col, (_, get) in enumerate(panels, start=1):
        for k, (name, arm) in enumerate(report["arms"].items()):
            st = get(arm) or {}
            mean = st.get("mean", math.nan)
            fig.add_bar(x=[name], y=[mean], name=name, marker_color=PALETTE[k % len(PALETTE)], showlegend=col == 1,
                        error_y={"type": "data", "symmetric": False, "array": [st.get("hi", math.nan) - mean],
                                 "arrayminus": [mean - st.get("lo", math.nan)]}, row=1, col=col)
    fig.update_layout(title=f"A/B experiment {report['experiment']} (95% CIs)", template="plotly_white",
                      width=max(700, 260 * len(panels)), height=420)
    return fig


PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2")


def write_figure(report: dict[str, Any], stem: Path) -> dict[str, str]:
    """HTML always; PNG when kaleido finds Chromium (the error is reported otherwise)."""
    fig = figure(report)
    out = {"html": str(stem.with_suffix(".html"))}
    fig.write_html(out["html"], include_plotlyjs=True)
    try:
        fig.write_image(str(stem.with_suffix(".png")))
        out["png"] = str(stem.with_suffix(".png"))
    except Exception as exc:  # kaleido raises several types when Chromium is missing
        out["png_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0] + " (needs chromium)"
    return out


def report_html(report: dict[str, Any]) -> str:
    """A self-contained page: the figure and the tests table."""
    rows = "".join(f"<tr><td>{html.escape(pair)}</td><td>{html.escape(k)}</td><td>{v.get('diff', math.nan):.4g}</td>"
                   f"<td>{v.get('p', math.nan):.3g}</td><td>{v['test']}</td></tr>"
                   for pair, t in report["tests"].items() for k, v in t.items())
    notes_html = "".join(f"<li>{html.escape(n)}</li>" for n in report["notes"])
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>A/B {html.escape(report['experiment'])}</title>"
            f"</head><body>{figure(report).to_html(full_html=False, include_plotlyjs=True)}"
            f"<table border=1><tr><th>arms</th><th>quantity</th><th>diff</th><th>p</th><th>test</th></tr>{rows}</table>"
            f"<ul>{notes_html}</ul></body></html>")


def _finite(value: Any) -> Any:
    """NaN/inf -> None, so the report is valid JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
