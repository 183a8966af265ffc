"""The openai backend over real HTTP, with the real `openai` client.

Server: a small uvicorn FastAPI app defined here (`scripted_app`) that speaks the OpenAI chat
protocol and answers from the request content: it solves the reply task it is given (so good
replies pass validation), but on purpose sends bad JSON, broken rules and role prefixes on some
requests, and 429 / 500 on the first hit of others. The last test points the backend at the real
`rolemrc serve` instead.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
from datagen_fixtures import read_outputs, small_pool
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rolemrc.core.io import read_jsonl
from rolemrc.datagen.backends.openai_api import PROFILE_SYSTEM, OpenAIBackend
from rolemrc.datagen.config import BackendConfig, BackendError, DatagenConfig
from rolemrc.datagen.pipeline import run
from rolemrc.datagen.profiles import COMPONENTS


def _h(*parts) -> int:
    return int(hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:8], 16)


def _profile_reply(messages, seed) -> str:
    persona = re.search(r"Persona: (.*)", messages[-1]["content"]).group(1)
    h = _h(persona)
    if h % 9 == 0:  # always incomplete: dropped after all attempts
        return json.dumps({"name": "Nobody", "components": {"speech_style": "flat"}})
    if h % 3 == 0 and seed == 0:  # bad JSON on the first attempt only
        return "Sure! Here is the profile: {name: oops"
    comps = {k: f"{k.replace('_', ' ')} of someone who is {persona.lower()}" for k in COMPONENTS}
    return "```json\n" + json.dumps({"name": f"Role {h % 1000}", "components": comps}) + "\n```"


def _solve(system: str) -> str:
    """A reply that satisfies the instructions in the backend's system prompt."""
    answer = re.search(r"The answer according to the passages: (.*)", system)
    text = f"Well, the passage says {answer.group(1)}." if answer else "I would rather not say, friend."
    if "describe at least one action" in system:
        text = "(nods) " + text
    rule = re.search(r"Formatting rule you must obey: (.*)", system)
    if rule:
        r = rule.group(1)
        if "emoji" in r:
            text = "\U0001F31F " + text
        elif m := re.search(r"word '(\w+)'", r):
            text += f" A {m.group(1)} for you."
        elif m := re.search(r"exact sentence: (.*)", r):
            text += " " + m.group(1)
        elif "capital" in r:
            text = text.upper()
        elif "lower case" in r:
            text = text.lower()
        elif "commas" in r:
            text = text.replace(",", "")
    return text


def _reply(messages, seed) -> str:
    if messages[0]["content"] == PROFILE_SYSTEM:
        return _profile_reply(messages, seed)
    h = _h(messages)
    if h % 13 == 0:  # always malformed: the item is dropped and counted
        return "User: I will answer for you instead."
    if h % 4 == 0 and seed == 0:  # malformed on the first attempt: asked again
        return _solve(messages[0]["content"]) + "\nUser: and now?"
    return _solve(messages[0]["content"])


def scripted_app(delay_s: float = 0.0, status: int | None = None):
    app = FastAPI()
    hits: Counter = Counter()
    app.state.hits = hits
    app.state.formats = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        hits["requests"] += 1
        if status is not None:
            return JSONResponse({"error": {"message": "invalid api key", "type": "auth"}}, status_code=status)
        key = json.dumps([body["messages"], body.get("seed")], sort_keys=True)
        hits[key] += 1
        hits["seeded"] += "seed" in body
        hits["structured " + json.dumps(body["messages"][0]["content"] == PROFILE_SYSTEM)] += "response_format" in body
        app.state.formats.append(body.get("response_format"))
        if hits[key] == 1 and _h(key) % 5 == 0:
            hits["429"] += 1
            return JSONResponse({"error": {"message": "slow down", "type": "rate_limit"}}, status_code=429)
        if hits[key] == 1 and _h(key) % 5 == 1:
            hits["500"] += 1
            return JSONResponse({"error": {"message": "boom", "type": "server"}}, status_code=500)
        if delay_s:
            await asyncio.sleep(delay_s)
        text = _reply(body["messages"], body.get("seed", 0))
        return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    return app


class Server:
    """uvicorn in a background thread on a free local port."""

    def __init__(self, app):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("scripted server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _config(out, url, pool, **backend) -> DatagenConfig:
    return DatagenConfig(out=out, size="tiny", mrc=pool, progress=False,
                         backend=BackendConfig(name="openai", base_url=url, model="scripted", concurrency=4,
                                               backoff_s=0.01, **backend))


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """16 triplets (12 answerable, 4 not, 10 domains): every run embeds the whole pool, ~0.1 CPU-s a triplet."""
    return small_pool(tmp_path_factory.mktemp("pool") / "mrc.jsonl", n=16)


@pytest.fixture(scope="module")
def cold_run(tmp_path_factory, pool):
    """One cold run over HTTP, its scripted server kept up for the module: (its directory, its result, the server,
    the files it wrote). A run's files depend on the pool and the config alone, not on which retries it met."""
    out = tmp_path_factory.mktemp("cold") / "run"
    with Server(scripted_app()) as server:
        result = run(_config(out, server.url, pool))
        yield out, result, server, read_outputs(out)


def test_retries_drops_cache_over_http(cold_run, pool):
    out, result, server, first = cold_run
    hits = server.app.state.hits
    assert hits["429"] > 0 and hits["500"] > 0  # both were retried, nothing crashed
    events = result["events"]
    unanswered = events["requests"] - hits["requests"]   # tries that never reached the app (a dropped connection)
    assert events["retries"] == hits["429"] + hits["500"] + unanswered
    assert events["malformed"] > 0
    dropped = result["stats"]["dropped"]
    assert dropped["profiles"] and set(dropped["profiles"]) <= {"missing component name_and_description"}
    assert dropped["synthesis"].get("speaks for another role", 0) > 0
    sft, test = read_jsonl(out / "sft.jsonl"), read_jsonl(out / "test.jsonl")
    assert len(sft) > 30 and len(test) > 10
    assert all("User:" not in t["content"] for r in sft for t in r["conversations"])
    before = hits["requests"]
    # rerun with the outputs removed: every reply comes from the SQLite cache
    for name in first:
        (out / name).unlink()
    (out / "work" / "items.jsonl").unlink()
    (out / "work" / "profiles.jsonl").unlink()
    again = run(_config(out, server.url, pool))
    assert hits["requests"] == before and again["events"].get("requests", 0) == 0
    assert again["events"]["cache_hits"] > 0
    assert read_outputs(out) == first


def test_requests_go_without_seeds_when_told(tmp_path):
    """--no-seed-requests: for servers that refuse per-request seeds (vLLM's CPU build)."""
    messages = [{"role": "user", "content": "Describe a lighthouse keeper."}]
    for seeded in (True, False):
        with Server(scripted_app()) as server:
            config = BackendConfig(name="openai", base_url=server.url, model="scripted", seed_requests=seeded,
                                   backoff_s=0.01)

            async def go(config: BackendConfig) -> str:
                backend = OpenAIBackend(config, cache_path=None)
                try:
                    return await backend.complete(messages, 2)
                finally:
                    await backend.aclose()

            asyncio.run(go(config))
            hits = server.app.state.hits   # (the scripted server may answer 429 or 500 first: a retry)
            assert hits["requests"] >= 1 and hits["seeded"] == (hits["requests"] if seeded else 0)


def test_structured_output_asks_for_profiles_by_json_schema(tmp_path, pool):
    """--structured-output: profile requests carry a JSON Schema response_format that fits max_tokens and
    requires exactly the components the validator requires; reply requests stay free text."""
    from rolemrc.datagen.backends.openai_api import profile_schema

    with Server(scripted_app()) as server:
        run(_config(tmp_path / "run", server.url, pool, structured=True, max_tokens=300))
        hits, formats = server.app.state.hits, [f for f in server.app.state.formats if f]
    assert hits["structured true"] >= 16 and hits["structured false"] == 0
    assert formats and all(f == profile_schema(300) for f in formats)
    components = formats[0]["json_schema"]["schema"]["properties"]["components"]
    assert components["required"] == list(COMPONENTS) and components["additionalProperties"] is False
    assert components["properties"]["background"]["maxLength"] * len(COMPONENTS) <= (300 - 100) * 3


def test_http_errors_that_are_not_retryable_stop_the_run(tmp_path, pool):
    async def call(url):
        backend = OpenAIBackend(BackendConfig(name="openai", base_url=url, model="m", backoff_s=0.01))
        try:
            await backend.profile({"id": "p", "persona": "A baker."})
        finally:
            await backend.aclose()

    with Server(scripted_app(status=401)) as server, pytest.raises(BackendError, match="HTTP 401"):
        asyncio.run(call(server.url))
    with socket.socket() as s:  # nothing listens here: connection errors are retried, then reported
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with pytest.raises(BackendError, match="giving up"):
        asyncio.run(call(dead))


def test_sigkill_mid_run_then_rerun_gives_identical_files(tmp_path, pool, cold_run):
    killed, expected = tmp_path / "killed", cold_run[3]   # a whole run's files: what the killed run must end with
    with Server(scripted_app(delay_s=0.03)) as server:
        args = [sys.executable, "-c", "from rolemrc.cli import main; main()", "datagen", "run", "--out", str(killed),
                "--size", "tiny", "--mrc", str(pool), "--backend", "openai", "--base-url", server.url,
                "--model", "scripted", "--concurrency", "4", "--no-progress"]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ})
        journal = killed / "work" / "items.jsonl"
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if journal.exists() and len(journal.read_bytes().splitlines()) >= 3:
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the run finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not (killed / "sft.jsonl").exists()
        done_before = len(journal.read_bytes().splitlines())
        result = run(_config(killed, server.url, pool))
        assert result["events"].get("cache_hits", 0) > 0  # work paid for before the kill is not paid again
    assert read_outputs(killed) == expected
    lines = [json.loads(x) for x in journal.read_bytes().splitlines()]
    assert len(lines) == len({x["key"] for x in lines}) > done_before  # no duplicate, none missing


def test_openai_backend_against_rolemrc_serve(tmp_path, model_dirs):
    """The same backend against the real `rolemrc serve` (the tiny untrained Llama): transport, seeds and
    the cache work; the model's free text is no profile JSON, so every attempt is counted malformed and
    the item fails with the parser's reason instead of slipping through."""
    from rolemrc.datagen.profiles import ProfileError
    from rolemrc.serve.launch import running_server

    with running_server({"models": {"tiny": {"path": str(model_dirs["llama"])}}, "db": None}, workdir=tmp_path) as server:
        config = BackendConfig(name="openai", base_url=f"{server.base_url}/v1", model="tiny", max_tokens=24,
                               max_attempts=2)

        async def go():
            backend = OpenAIBackend(config, cache_path=tmp_path / "cache.sqlite")
            try:
                messages = [{"role": "user", "content": "Describe a lighthouse keeper."}]
                first, again = await backend.complete(messages, 0), await backend.complete(messages, 0)
                with pytest.raises(ProfileError):
                    await backend.profile({"persona": "a lighthouse keeper"})
                return first, again, dict(backend.events)
            finally:
                await backend.aclose()

        first, again, events = asyncio.run(go())
    assert isinstance(first, str) and first and first == again
    assert events["requests"] == 3 and events["cache_hits"] == 1 and events["malformed"] == 2


def test_bench_datagen_without_a_model_name_is_one_error_line(tmp_path):
    """A served endpoint without --model is refused before anything runs: one `error:` line, exit 2, no files."""
    from typer.testing import CliRunner

    from rolemrc.cli import app
    from rolemrc.core.errors import EXIT_INPUT

    keep = tmp_path / "runs"
    result = CliRunner().invoke(app, ["bench", "datagen", "--base-url", "http://127.0.0.1:9/v1", "--keep", str(keep)])
    assert result.exit_code == EXIT_INPUT, result.output
    assert "error: name the served model with --model" in result.output and not keep.exists()


def test_bench_datagen_side_by_side(tmp_path, pool):
    """`rolemrc bench datagen`: the template backend and a served model over the same personas, cold; the
    JSON's shares agree with the backend's own counts and with the files written."""
    from typer.testing import CliRunner

    from rolemrc.bench.cli import app
    from rolemrc.core.errors import InputError

    keep = tmp_path / "runs"
    with Server(scripted_app()) as server:
        result = CliRunner().invoke(app, ["datagen", "--base-url", server.url, "--model", "scripted", "--mrc", str(pool),
                                          "--concurrency", "4", "--keep", str(keep), "--json", str(tmp_path / "b.json")])
        assert result.exit_code == 0, result.output
        report = json.loads((tmp_path / "b.json").read_text())
        hits = server.app.state.hits
        with pytest.raises(InputError, match="fresh directory"):   # a second run would replay the cache
            from rolemrc.bench.datagen import run as bench_run
            bench_run(server.url, "scripted", mrc=pool, keep=keep, progress=False)
    template, served = report["template"], report["openai"]
    for side, name in ((template, "template"), (served, "openai")):
        assert set(side["seconds"]) == {"profiles", "retrieval", "synthesis"}
        written = {f: len(read_jsonl(keep / name / f"{f}.jsonl")) for f in ("sft", "pairs", "test")}
        assert side["records"] == {**written, "total": sum(written.values())} and side["records_per_min"] > 0
    assert template["items"]["dropped"] == 0 and template["profiles"]["dropped"] == 0
    events = served["events"]
    assert events["requests"] >= hits["requests"]   # every try the server saw was counted (+ any dropped connection)
    assert served["replies"] == events["requests"] - events["retries"] == events["completion_tokens"]  # 1 token each
    assert served["malformed_reply_share"] == round(events["malformed"] / served["replies"], 4)
    assert 0 < served["malformed_reply_share"] < 1
    assert served["profiles"]["dropped"] > 0 and served["items"]["dropped"] > 0     # the scripted always-bad ones
    assert served["drop_reasons"]["synthesis"]["speaks for another role"] > 0
    assert 0 < report["records_kept_share"] < 1
    assert len(report["examples"]) == 3
    for example in report["examples"]:
        for name in ("template", "openai"):
            assert [t["role"] for t in example[name]][-1] == "assistant"
