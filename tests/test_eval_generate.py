"""eval generation (local HF model, restraint hooks, OpenAI-compatible endpoint), the openai judge and the CLI.

HTTP tests use the scripted uvicorn FastAPI server `Server` of tests/test_datagen_openai.py with an
app defined here that speaks the OpenAI chat protocol (`rolemrc.serve` did not exist yet).
"""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from test_datagen_openai import Server
from typer.testing import CliRunner

from rolemrc.core.io import read_jsonl, write_jsonl
from rolemrc.core.records import normalize_turns
from rolemrc.core.taxonomy import TASK_COUNTS, judge_aspects_for_task
from rolemrc.eval import JudgeConfig, judge, score
from rolemrc.eval.generate import GenerateConfig, GenerationError, generate

# judge reply by a cue of each aspect's question (prompts.CRITERIA), first match wins:
# multi_turn -> 1, prioritized -> 0, nested -> gibberish (unparseable), style -> **0**, knowledge -> 1
VERDICTS = (("user insists", "Score: 1"), ("global system rule", "0"), ("special content", "As an AI, I find this delightful!"),
            ("speech style", "**0**"), ("", "Reasoning: it answers from the passage.\nScore: 1"))


def openai_app(kind: str):
    """`generate`: echoes the last user turn's first words; `judge`: scripted verdict strings.
    The first request of every distinct body fails with 429 (generate) or 500 (judge) once."""
    app = FastAPI()
    hits: Counter = Counter()
    app.state.hits, app.state.bodies = hits, []

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        app.state.bodies.append(body)
        key = json.dumps(body["messages"], sort_keys=True)
        hits[key] += 1
        hits["requests"] += 1
        if hits[key] == 1:
            status = 429 if kind == "generate" else 500
            return JSONResponse({"error": {"message": "try again", "type": "server"}}, status_code=status)
        last = body["messages"][-1]["content"]
        if kind == "generate":
            text = " ".join(last.split()[:4])
        else:
            question = last.split("# Question")[-1]
            text = next(reply for cue, reply in VERDICTS if cue in question)
        return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": len(text.split()), "total_tokens": 0}}

    return app


def test_local_generation_batched_equals_single(model_dirs, records):
    data = records[:6]
    batched = generate(data, model=str(model_dirs["llama"]), max_new_tokens=12, batch_size=4, progress=False)
    single = generate(data, model=str(model_dirs["llama"]), max_new_tokens=12, batch_size=1, progress=False)
    assert [r["response"] for r in batched] == [r["response"] for r in single]
    for rec, out in zip(data, batched):
        assert out["id"] == rec["id"] and out["question"] == normalize_turns(rec["question"])
        assert out["reference"] == rec["reference"] and out["fields"] == {"turns": "question", "reference": "reference", "id": "id"}
        assert 0 < out["tokens"] <= 12 and out["latency"] > 0 and out["truncated"] is False


def test_local_generation_truncates_long_prompts_and_refuses_no_room(model_dirs, records):
    out = generate(records[:2], model=str(model_dirs["gpt2"]), max_new_tokens=505, batch_size=2, progress=False)
    assert all(r["truncated"] for r in out)  # 512 positions leave 7 prompt tokens
    with pytest.raises(GenerationError, match="no room"):
        generate(records[:1], model=str(model_dirs["gpt2"]), max_new_tokens=512, progress=False)


def test_restraint_changes_generation_and_identity_restraint_does_not(model_dirs, records):
    pytest.importorskip("rolemrc.intervene")
    data, path = records[:4], str(model_dirs["qwen2"])
    plain = generate(data, model=path, max_new_tokens=10, progress=False)
    every = {0: list(range(96)), 1: list(range(96))}
    same = generate(data, model=path, max_new_tokens=10, progress=False,
                    restraint={"name": "identity", "hook": "mlp.act", "factor": 1.0, "units": every})
    ablated = generate(data, model=path, max_new_tokens=10, progress=False,
                       restraint={"name": "ablate", "hook": "mlp.act", "factor": 0.0, "units": every})
    assert [r["response"] for r in same] == [r["response"] for r in plain]
    assert [r["response"] for r in ablated] != [r["response"] for r in plain]
    from rolemrc.intervene import RestraintError

    with pytest.raises(RestraintError, match="out of range"):
        generate(data, model=path, progress=False, restraint={"name": "bad", "hook": "mlp.act", "units": {5: [0]}})


def test_endpoint_generation_retries_and_extra_body(records):
    app = openai_app("generate")
    with Server(app) as server:
        out = generate(records[:5], model="dpo", base_url=server.url, concurrency=2, backoff_s=0.01, progress=False,
                       extra_body={"restraint": "multi-turn-restraint"})
    assert app.state.hits["requests"] == 10  # each first try answered 429, then retried
    assert all(b["restraint"] == "multi-turn-restraint" and b["max_tokens"] == 256 for b in app.state.bodies)
    for rec, res in zip(records, out):
        assert res["id"] == rec["id"] and res["response"] == " ".join(rec["question"][-1]["content"].split()[:4])
        assert res["tokens"] == len(res["response"].split()) and res["latency"] > 0
    app.state.bodies.clear()
    with Server(app) as server:   # A/B traffic for rolemrc serve: each request names its user, task and reference
        generate(records[:3], model="dpo", base_url=server.url, backoff_s=0.01, progress=False,
                 extra_body={"experiment": "ab", "metadata": {"run": 1}})
    sent = {b["user"]: b for b in app.state.bodies}.values()   # retries send the same body again
    assert sorted((b["user"], b["experiment"], b["metadata"]) for b in sent) == sorted(
        (r["id"], "ab", {"task": r.get("task"), "reference": r["reference"], "run": 1}) for r in records[:3])
    with Server(app) as server, pytest.raises(GenerationError, match="giving up"):
        generate(records[5:6], model="dpo", base_url=server.url, max_retries=0, progress=False)
    with pytest.raises(ValueError, match="extra_body"):
        GenerateConfig(model="dpo", base_url="http://x/v1", restraint={"name": "r"})


def test_openai_judge_over_http_counts_unparseable_and_caches(records, tmp_path):
    items = [dict(r, response="some reply") for r in records]
    app = openai_app("judge")
    with Server(app) as server:
        config = JudgeConfig(name="openai", model="judge", base_url=server.url, concurrency=4, backoff_s=0.01,
                             cache=tmp_path / "c.sqlite")
        verdicts = judge(items, config)
        first = app.state.hits["requests"]
        again = judge(items, config)
        assert app.state.hits["requests"] == first  # every verdict replayed from the SQLite cache
    expected = {"knowledge_boundary": 1, "role_style": 0, "multi_turn": 1, "prioritized": 0, "nested": None}
    assert len(verdicts) == sum(len(judge_aspects_for_task(r["task"])) for r in records)
    for v in verdicts:
        assert v.score == expected[v.dimension], v
        assert v.status == ("unparseable" if v.dimension == "nested" else "ok")
    assert [v.to_dict() for v in again] == [v.to_dict() for v in verdicts]
    run = score(items, config, metrics=None, rounds=200)
    status = run.summary["judge_aggregates"]["status"]
    assert status["unparseable"] == sum(v.dimension == "nested" for v in verdicts) > 0
    assert "nested" not in run.summary["judge_aggregates"]["dimensions"]


def full_histogram_records() -> list[dict]:
    question = [{"role": "user", "content": "Question: why?"}]
    return [{"id": f"{t}/{k}", "task": t, "question": question, "reference": "because"}
            for t, n in TASK_COUNTS.items() for k in range(n)]


def test_dataset_histogram_check():
    from rolemrc.eval.dataset import DatasetDrift, check_dataset

    full = full_histogram_records()
    assert len(full) == 1400 and check_dataset(full, "rolemrc")["drift"] == {}
    with pytest.raises(DatasetDrift, match=r"role_unrelated_mrc_refused_no_narration-2ndanswer: expected 100, found 99"):
        check_dataset(full[:-1], "rolemrc")
    assert check_dataset(full[:-1], "rolemrc", allow_drift=True)["drift"]


def test_cli_run_compare_report(model_dirs, records, tmp_path):
    from rolemrc.eval.cli import app

    data = tmp_path / "test.jsonl"
    write_jsonl(data, records[:18])
    runner = CliRunner()
    base = ["run", "--data", str(data), "--max-new-tokens", "6", "--metrics", "bleu,rouge", "--rounds", "200"]
    drift = runner.invoke(app, [*base, "--model", str(model_dirs["llama"]), "--out", str(tmp_path / "a"),
                                "--dataset", "rolemrc"])
    assert drift.exit_code == 2 and "--allow-drift" in drift.output and not (tmp_path / "a").exists()
    for name, arch in (("a", "llama"), ("b", "qwen2")):
        result = runner.invoke(app, [*base, "--model", str(model_dirs[arch]), "--out", str(tmp_path / name),
                                     "--dataset", "rolemrc", "--allow-drift"])
        assert result.exit_code == 0, result.output
        assert len(read_jsonl(tmp_path / name / "responses.jsonl")) == 18
        report = json.loads((tmp_path / name / "report.json").read_text())
        assert (tmp_path / name / "chart.html").is_file() and report["chart"]["html"].endswith("chart.html")
    result = runner.invoke(app, ["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp"),
                                 "--rounds", "500"])
    assert result.exit_code == 0, result.output
    assert re.search(r"\| all \| [\d.]+ \| [\d.]+ \|", result.output)
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text())["shared_items"] == 18
    result = runner.invoke(app, ["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "rep")])
    assert result.exit_code == 0 and (tmp_path / "rep" / "table3.md").read_text().count("\n") == 4
    bad = runner.invoke(app, ["compare", str(tmp_path / "a"), str(tmp_path / "nowhere")])
    assert bad.exit_code == 2 and "nowhere: no such folder" in bad.output
