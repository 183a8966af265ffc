"""An experiment's report over the server's request log (serve/store/), computed here, never in the serving
process: per-arm scores from the eval module (a judge from eval.judges, reference metrics), operational stats
(latency, tokens) and unpaired tests of each arm against the first. Arms are assigned per user, so the user is the
unit: every quantity is first averaged per user (a request without a user is its own cluster), CIs resample users
(a cluster bootstrap) and tests are Welch's t on the per-user means; for the judge's binary verdicts that is Welch
on per-user pass proportions. Requests an arm refused (`refused` rows: the server logs every request assigned to an
arm) are counted per arm and the arms' refusal rates tested against each other: rates that differ are flagged, since
each arm's scored rows are then a differently filtered sample of the traffic."""

from __future__ import annotations

import html
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from rolemrc.core.errors import RolemrcError
from rolemrc.core.figures import write_figure
from rolemrc.core.stats import TEST_LABELS, cluster_means, mean_ci, rates_test, welch
from rolemrc.eval.judges import JudgeConfig, judge_info
from rolemrc.serve.store import Store

COMPLETED = ("stop", "length")   # other finish reasons (refused, error, timeout, disconnected, shutdown): failed
REFUSED = "refused"              # turned away once its arm was assigned (a 4xx: context, queue, limits), never generated
ALPHA = 0.05                     # arms whose refusal rates differ at p below this are flagged
OPERATIONAL = ("latency_s", "completion_tokens", "response_chars")
UNIT_NOTE = (": arms are assigned per user, so each quantity is averaged per user first (a request without a user "
             "is its own cluster); CIs resample users, tests are Welch's t on per-user means (judge: Welch on per-user "
             "pass proportions, a response's score being the share of its judge calls that passed)")


class UnknownExperimentError(RolemrcError, LookupError):
    """The request log has no experiment of that id."""


def cluster(row: dict[str, Any]) -> str:
    """The unit a request belongs to: its user, or the request itself when it names no user (the choices of one
    request, logged as `<id>:<index>`, are one cluster)."""
    return f"user:{row['user']}" if row.get("user") else f"request:{row['id'].split(':')[0]}"


def unit_text(users: int, requests: int) -> str:
    return f"unit: user ({users} users, {requests} requests)"


def _items(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Eval items from logged chat requests whose metadata carries a task and/or a reference."""
    items = []
    for row in rows:
        meta = row.get("metadata") or {}
        if row["endpoint"] != "chat" or not ({"task", "reference"} & set(meta)):
            continue
        items.append({"id": row["id"], "task": str(meta.get("task") or ""), "question": row["messages"],
                      "reference": str(meta.get("reference") or ""), "response": row["response"],
                      "latency": row["latency_s"], "cluster": cluster(row)})
    return items


def referenced_cases(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The eval items (`_items`) of every completed request whose metadata carries a reference: what `--measure kl`
    scores every arm on (`ab.divergence.kl_report`)."""
    return [i for i in _items([r for r in rows if r["finish_reason"] in COMPLETED]) if i["reference"]]


def by_user(values: list[float], clusters: list[str], rounds: int) -> tuple[np.ndarray, dict[str, Any]]:
    """(per-user means, their mean with a bootstrap CI over users, plus the request count)."""
    means = cluster_means(values, clusters)
    return means, mean_ci(means, rounds=rounds) | {"requests": len(values), "unit": "user"}


def _judge_scores(items: list[dict[str, Any]], config: JudgeConfig, rounds: int) -> tuple[dict, list[float], list[str]]:
    """(judge summary, per-response scores, their clusters): a response's score is the share of its judge
    calls that passed, so a response judged on several aspects is one sample, not several."""
    from rolemrc.eval import score

    run = score(items, judge=config, metrics=None, rounds=rounds)
    per_response: dict[str, list[int]] = {}
    for v in run.verdicts:
        if v.get("score") is not None:
            per_response.setdefault(v["id"], []).append(v["score"])
    where = {i["id"]: i["cluster"] for i in items}
    agg = run.summary["judge_aggregates"]
    summary = {**judge_info(config), "calls": agg["calls"], "scored": agg["scored"],
               "responses_scored": len(per_response), "averages": agg.get("averages", {}),
               "dimensions": agg.get("dimensions", {})}
    return summary, [sum(s) / len(s) for s in per_response.values()], [where[i] for i in per_response]


def score_arm(rows: list[dict[str, Any]], judge: JudgeConfig, metrics: tuple[str, ...], rounds: int) -> tuple[dict, dict]:
    """(summary, per-user values of each quantity for the tests) of one arm's logged requests."""
    from rolemrc.eval.metrics import MetricConfig, compute

    clusters = [cluster(r) for r in rows]
    per_request: dict[str, tuple[list[float], list[str]]] = {
        "latency_s": ([r["latency_s"] for r in rows], clusters),
        "completion_tokens": ([float(r["completion_tokens"]) for r in rows], clusters),
        "response_chars": ([float(len(r["response"])) for r in rows], clusters)}
    summary: dict[str, Any] = {"n": len(rows), "users": len(set(clusters)),
                               "finish_length_rate": (sum(r["finish_reason"] == "length" for r in rows) / len(rows)
                                                      if rows else math.nan)}
    items = _items(rows)
    referenced = [i for i in items if i["reference"]]
    summary["with_reference"], summary["with_task"] = len(referenced), sum(bool(i["task"]) for i in items)
    if referenced and metrics:
        result = compute([i["response"] for i in referenced], [i["reference"] for i in referenced],
                         MetricConfig(groups=metrics))
        summary["metrics_unavailable"] = result.unavailable
        per_request |= {f"metric:{k}": (v, [i["cluster"] for i in referenced]) for k, v in result.values.items()}
    if items:
        summary["judge"], scores, where = _judge_scores(items, judge, rounds)
        per_request["judge_score"] = (scores, where)
    values: dict[str, np.ndarray] = {}
    for key, (vals, where) in per_request.items():
        values[key], stat = by_user(vals, where, rounds)
        if key == "judge_score":
            summary["judge"]["response_score"] = stat
        elif key.startswith("metric:"):
            summary.setdefault("metrics", {})[key.removeprefix("metric:")] = stat
        else:
            summary[key] = stat
    return summary, values


def build_report(store: Store, exp_id: str, *, judge: str | JudgeConfig = "rules",
                 metrics: tuple[str, ...] = ("bleu", "rouge"), rounds: int = 2000,
                 out_dir: str | Path | None = None, kl: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report dict; with `out_dir`, also report.json, chart.html and chart.png there. `judge`: a
    JudgeConfig (an endpoint judge needs its model and base URL) or the name of an offline judge. `kl`: `model` (the
    served model's weights) and `base` (its SFT model), to score every arm by KL on the logged references too
    (`ab.divergence.kl_report`: each arm's KL per token and restoration, paired against the control)."""
    config = judge if isinstance(judge, JudgeConfig) else JudgeConfig(name=judge)
    exp = store.experiment(exp_id)
    if exp is None:
        raise UnknownExperimentError(f"no experiment {exp_id!r} in {store.name}")
    rows = store.requests(exp_id)
    arms: dict[str, Any] = {}
    per_user: dict[str, dict[str, np.ndarray]] = {}
    for arm in exp["arms"]:
        mine = [r for r in rows if r["arm"] == arm["name"]]
        done = [r for r in mine if r["finish_reason"] in COMPLETED]
        summary, values = score_arm(done, config, metrics, rounds)
        failed = Counter(r["finish_reason"] for r in mine if r["finish_reason"] not in COMPLETED)
        arms[arm["name"]] = {"model": arm["model"], "restraint": arm.get("restraint"), "weight": arm["weight"],
                             **summary, "failed": sum(failed.values()), "failed_by_reason": dict(failed)}
        per_user[arm["name"]] = values
    names = list(arms)
    control = names[0]
    tests = {f"{name} vs {control}": {key: welch(per_user[control][key], per_user[name][key], rounds=rounds)
                                      | {"unit": "user"}
                                      for key in per_user[control].keys() & per_user[name].keys()}
             for name in names[1:]}
    users = len({cluster(r) for r in rows})
    unit = {"name": "user", "users": users, "requests": len(rows), "text": unit_text(users, len(rows))}
    refused = refusals(rows, names)
    report = {"experiment": exp_id, "description": exp["description"], "requests": len(rows), "unit": unit,
              "control": control, "arms": arms, "tests": tests, "refusals": refused,
              "notes": [unit["text"] + UNIT_NOTE, *([refused["text"]] if refused["refused"] else []), *notes(arms)]}
    if kl is not None:
        from rolemrc.ab.divergence import kl_report

        report["kl"] = kl_report(store, exp, referenced_cases(rows), rounds=rounds, **kl)
        for name, scored in report["kl"].get("arms", {}).items():
            arms[name] |= {k: scored[k] for k in ("kl_per_token", "restoration")}
            if "vs_control" in scored:
                test = scored["vs_control"]
                tests[f"{name} vs {control}"]["restoration"] = test | {"n_a": test["n"], "n_b": test["n"]}
        if "note" in report["kl"]:
            report["notes"].append(report["kl"]["note"])
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        report["files"] = write_figure(figure(report), out, "chart", plotlyjs=True, width=None, height=None)
        (out / "report.json").write_text(json.dumps(_finite(report), indent=1, allow_nan=False))
    return _finite(report)


def refusals(rows: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Per arm, its requests and those refused (a request is refused whole: every row of it says `refused`, its
    `error_code` why), and whether the arms' refusal rates differ: Fisher's exact test for two arms, Pearson's
    chi-square for more, the request as the unit (requests of one user are taken as independent here). `flagged` when
    p < ALPHA; `text` says so in one line."""
    arms = {}
    for name in names:
        requests: dict[str, dict[str, Any]] = {}
        for row in rows:
            if row["arm"] == name:
                requests.setdefault(row.get("request_id") or row["id"].split(":")[0], row)
        refused = [r for r in requests.values() if r["finish_reason"] == REFUSED]
        arms[name] = {"requests": len(requests), "refused": len(refused),
                      "rate": len(refused) / len(requests) if requests else math.nan,
                      "by_code": dict(Counter(r.get("error_code") or "unknown" for r in refused))}
    test = rates_test([a["refused"] for a in arms.values()], [a["requests"] for a in arms.values()])
    flagged = bool(test["p"] < ALPHA)
    counts = ", ".join(f"{name} {a['refused']}/{a['requests']}" for name, a in arms.items())
    tested = f"{TEST_LABELS[test['test']]}, p = {_num(test['p'], '.3g')}"
    text = (f"FLAG: the arms' refusal rates differ ({counts} requests refused; {tested} < {ALPHA}): each arm's scored "
            "rows are a differently filtered sample of its traffic, so their scores compare different requests"
            if flagged else f"refusals: {counts} requests refused ({tested}; flagged below {ALPHA})")
    return {"arms": arms, "refused": sum(a["refused"] for a in arms.values()), **test,
            "test_label": TEST_LABELS[test["test"]], "unit": "request", "alpha": ALPHA, "flagged": flagged,
            "text": text}


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

    panels = [("judge score (per-user mean)", lambda a: (a.get("judge") or {}).get("response_score")),
              *[(f"metric {k}", lambda a, k=k: (a.get("metrics") or {}).get(k))
                for k in sorted({k for a in report["arms"].values() for k in (a.get("metrics") or {})})],
              *[(k, lambda a, k=k: a.get(k)) for k in OPERATIONAL],
              *[(title, lambda a, k=k: a.get(k)) for k, title in KL_PANELS.items()
                if report.get("kl", {}).get("arms")]]
    cols = min(PANEL_COLUMNS, len(panels))
    rows = -(-len(panels) // cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[t for t, _ in panels])
    for p, (_, get) in enumerate(panels):
        for k, (name, arm) in enumerate(report["arms"].items()):
            mean, lo, hi = (math.nan if v is None else v for v in map((get(arm) or {}).get, ("mean", "lo", "hi")))
            fig.add_bar(x=[name], y=[mean], name=name, marker_color=PALETTE[k % len(PALETTE)], showlegend=p == 0,
                        error_y={"type": "data", "symmetric": False, "array": [hi - mean], "arrayminus": [mean - lo]},
                        row=p // cols + 1, col=p % cols + 1)
    fig.update_xaxes(showticklabels=False)   # the legend names the arms by colour: long names overlap the panels
    fig.update_layout(title=f"A/B experiment {report['experiment']} ({report['unit']['text']}; 95% CIs over users)",
                      template="plotly_white", width=max(700, 300 * cols), height=160 + 250 * rows,
                      legend={"orientation": "h", "x": 0, "y": -0.02, "yanchor": "top"})
    return fig


# `--measure kl`: each arm scored on every referenced request, paired
KL_PANELS = {"restoration": "restoration (of KL to SFT)", "kl_per_token": "KL per token to SFT"}
PANEL_COLUMNS = 3   # panels per row of the chart: it stays legible at a page's width
PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2")


def _num(value: float | None, spec: str) -> str:
    return "–" if value is None or not math.isfinite(value) else format(value, spec)


def report_html(report: dict[str, Any]) -> str:
    """A self-contained page: the unit, the figure and the tests table."""
    rows = "".join(f"<tr><td>{html.escape(pair)}</td><td>{html.escape(k)}</td><td>{_num(v.get('diff'), '.4g')}</td>"
                   f"<td>{_num(v.get('p'), '.3g')}</td><td>{v.get('n_a')} / {v.get('n_b')}</td>"
                   f"<td>{html.escape(TEST_LABELS[v['test']])} on per-user means (CI: bootstrap over users)</td></tr>"
                   for pair, t in report["tests"].items() for k, v in sorted(t.items()))
    notes_html = "".join(f"<li>{html.escape(n)}</li>" for n in report["notes"])
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>A/B {html.escape(report['experiment'])}</title>"
            f"</head><body><p>{html.escape(report['unit']['text'])}</p>{refusal_html(report)}"
            f"{figure(report).to_html(full_html=False, include_plotlyjs=True)}"
            "<table border=1><tr><th>arms</th><th>quantity</th><th>diff</th><th>p</th><th>users (control / arm)</th>"
            f"<th>test</th></tr>{rows}</table>"
            f"<ul>{notes_html}</ul></body></html>")


def refusal_html(report: dict[str, Any]) -> str:
    """The refusal line (bold when the arms' rates differ), if any request was refused."""
    refused = report.get("refusals") or {}
    if not refused.get("refused"):
        return ""
    text = html.escape(refused["text"])
    return f"<p><strong>{text}</strong></p>" if refused["flagged"] else f"<p>{text}</p>"


def _finite(value: Any) -> Any:
    """NaN/inf -> None, so the report is valid JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
