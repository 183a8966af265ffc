"""Every experiment request in the A/B log, over real HTTP: a timeout, a disconnect (whole and streamed), a NaN from
a huge factor and a SIGTERM each leave exactly one row saying so; an n=3 request's rows are written together; an
idempotent retry logs once and replays; a failed prefill group ends its rows at once; a step that does not return
reads `stalled` in /health. Faults are injected into the real server by a `sitecustomize` (restraints named `slow`,
`boom`, `stall` slow a forward, fail a step, or hold one). Three server processes: one the module's checks share, one
that a dead engine makes exit (`on_engine_dead: exit`), and one shared by the checks that end something in it (an
engine with `serve_others`, then the process with SIGTERM)."""

import json
import signal
import socket
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

import httpx
import pytest

import rolemrc
from rolemrc.intervene import Restraint
from rolemrc.serve.launch import start_server, stop_server

CHAT = [{"role": "user", "content": "the keeper of the lighthouse"}]
FAULTS = '''
import time
import rolemrc.generate.engine as engine

def names(requests):
    return {r.restraint.name for r in requests if r.restraint is not None}

forward, advance = engine.Engine._forward, engine.Engine._advance

def slow_forward(self, *args, **kw):
    held = names(self.running)
    if "slow" in held:
        time.sleep(0.05)
    if "stall" in held:
        time.sleep(2.5)
    return forward(self, *args, **kw)

def failing_advance(self, requests, *args):
    if "boom" in names(requests):
        raise RuntimeError("boom")
    if "die" in names(requests):   # what no `except Exception` catches: the scheduler thread ends
        raise SystemExit("die")
    return advance(self, requests, *args)

engine.Engine._forward, engine.Engine._advance = slow_forward, failing_advance

# a request whose metadata says {"pause": POINT} waits 1 s at that point of the handler (its client leaves meanwhile)
import asyncio, contextvars
import rolemrc.serve.completions as completions
import rolemrc.serve.idempotency as idempotency

PAUSE = contextvars.ContextVar("pause", default=None)
route, claim, submit_all = completions.route, idempotency.claim, completions.submit_all

async def paused_route(state, body):
    PAUSE.set((body.metadata or {}).get("pause"))
    if PAUSE.get() == "route":
        await asyncio.sleep(1)
    return await route(state, body)

async def paused_claim(*args):
    held = await claim(*args)
    if PAUSE.get() == "claim":
        await asyncio.sleep(1)
    return held

async def paused_submit_all(*args):
    choices = await submit_all(*args)
    if PAUSE.get() == "admitted":
        await asyncio.sleep(1)
    return choices

completions.route, idempotency.claim, completions.submit_all = paused_route, paused_claim, paused_submit_all

# hashing a model's weights takes 2 s, as on a large model
import rolemrc.core.modeling as modeling
weights_fingerprint = modeling.model_fingerprint

def slow_fingerprint(model):
    time.sleep(2)
    return weights_fingerprint(model)

modeling.model_fingerprint = slow_fingerprint
'''


def launch(model_dirs, root, **config):
    """A server whose model `tiny` has the fault restraints, with experiments `exp` (plain), `slow`, and `nan` (a
    factor of 1e30 on a GPT-2, whose LayerNorm turns it into NaN; RMSNorm models stay finite)."""
    names = {"slow": 1.0, "boom": 1.0, "stall": 1.0, "die": 1.0, "huge": 1e30}
    for name, factor in names.items():
        Restraint(name=name, hook="mlp.act", factor=factor, units={0: list(range(96)), 1: list(range(96))}).save(
            root / f"{name}.yaml")
    (root / "sitecustomize.py").write_text(FAULTS)
    src = str(Path(rolemrc.__file__).parents[1])
    config = {"models": {"tiny": {"path": str(model_dirs["llama"]), **config.pop("engine", {})},
                         "g": {"path": str(model_dirs["gpt2"])}}, "db": "ab.sqlite",
              "restraints": {name: f"{name}.yaml" for name in names}, "max_new_tokens": 400,
              "allow_inline_restraints": True, "allow_no_auth": True, **config}
    server = start_server(config, workdir=root, env={"PYTHONPATH": f"{root}:{src}"})
    for exp, arm in (("exp", {}), ("slow", {"restraint": "slow"}), ("nan", {"model": "g", "restraint": "huge"})):
        arms = [{"name": "a", "model": "tiny", **arm}]
        assert httpx.post(server.base_url + "/v1/experiments", json={"id": exp, "arms": arms}).status_code == 201
    return server


def rows(root, case):
    with sqlite3.connect(root / "ab.sqlite") as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("SELECT * FROM requests WHERE json_extract(metadata, '$.case') = ? "
                                            "ORDER BY id", (case,))]


def wait_rows(root, case, timeout=20):
    deadline = time.monotonic() + timeout
    while not (found := rows(root, case)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def ask(exp, case, **extra):
    return {"model": "ab", "messages": CHAT, "experiment": exp, "user": "u1", "metadata": {"case": case},
            "max_tokens": 4, **extra}


def said(line):
    """A streamed chunk with text in it."""
    return '"content": "' in line and '"content": ""' not in line


@pytest.fixture(scope="module")
def served(model_dirs, tmp_path_factory):
    """The server most checks share: request_timeout_s 4; model tiny reads `stalled` after a 1 s step."""
    root = tmp_path_factory.mktemp("serve-log")
    server = launch(model_dirs, root, request_timeout_s=4, engine={"stall_after_s": 1})
    yield server, root
    stop_server(server)


@pytest.fixture(scope="module")
def ending(model_dirs, tmp_path_factory):
    """`ending()`: (server, root) of a server (shutdown_grace_s 2) for the checks that end something in it: model g's
    engine (on_engine_dead serve_others; the other checks use tiny) and the process (SIGTERM). Started at the first
    call, and again, in a fresh folder, at a call that finds it exited: either check may run first."""
    started = []

    def get():
        if not started or started[-1][0].proc.poll() is not None:
            root = tmp_path_factory.mktemp("serve-log-ending")
            started.append((launch(model_dirs, root, shutdown_grace_s=2), root))
        return started[-1]
    yield get
    for server, _ in started:
        stop_server(server)


def test_timeout_disconnects_and_nan_each_leave_one_row(served):
    server, root = served
    url = server.base_url + "/v1/chat/completions"
    late = httpx.post(url, json=ask("slow", "timeout", max_tokens=400, ignore_eos=True),
                      headers={"Idempotency-Key": "late"}, timeout=60)
    assert late.status_code == 504 and late.json()["error"]["code"] == "timeout"
    [row] = wait_rows(root, "timeout")
    assert row["finish_reason"] == "timeout" and row["response"]   # the text generated so far
    # a 504 tells its client to retry: its key was freed, so a retry (a shorter one) runs: no replay, no 422
    retry = httpx.post(url, json=ask("slow", "timeout-retry"), headers={"Idempotency-Key": "late"}, timeout=60)
    assert retry.status_code == 200 and "Idempotent-Replayed" not in retry.headers

    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=ask("slow", "gone", max_tokens=400, ignore_eos=True), timeout=1.0)
    [row] = wait_rows(root, "gone")
    assert row["finish_reason"] == "disconnected"

    with httpx.stream("POST", url, json=ask("slow", "gone-stream", max_tokens=400, ignore_eos=True, stream=True),
                      timeout=60) as stream:
        next(line for line in stream.iter_lines() if said(line))
    [row] = wait_rows(root, "gone-stream")
    assert row["finish_reason"] == "disconnected" and row["response"]

    nan = httpx.post(url, json=ask("nan", "nan"), timeout=60)
    assert nan.status_code == 500 and nan.json()["error"]["code"] == "generation_failed"
    [row] = wait_rows(root, "nan")
    assert row["finish_reason"] == "error"
    nan = httpx.post(url, json=ask("nan", "nan-stream", stream=True), timeout=60)
    assert '"generation_failed"' in nan.text and "[DONE]" not in nan.text
    assert [r["finish_reason"] for r in wait_rows(root, "nan-stream")] == ["error"]
    time.sleep(1)   # nothing more arrives late
    assert all(len(rows(root, case)) == 1 for case in ("timeout", "gone", "gone-stream", "nan", "nan-stream"))


def test_a_stream_left_before_its_first_byte_is_closed_and_logged(served):
    """A client that sends a streamed request and closes its socket at once: the call still ends (its engine slot
    freed: a leaked slot per such request would fill the queue) and writes its row. (uvicorn pauses reading once the
    body is in, so the disconnect is seen only after the events have started.)"""
    server, root = served
    host, port = server.base_url.removeprefix("http://").split(":")
    for k in range(4):
        body = json.dumps(ask("slow", f"left-{k}", max_tokens=400, ignore_eos=True, stream=True)).encode()
        with socket.create_connection((host, int(port))) as conn:
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
    for k in range(4):
        [row] = wait_rows(root, f"left-{k}")
        assert row["finish_reason"] == "disconnected" and row["completion_tokens"] < 400, row


def admitted(server) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith('rolemrc_admitted{model="tiny"}'))


@pytest.mark.parametrize("point", ["route", "claim", "admitted"])
def test_a_stream_abandoned_at_each_point_of_the_handler_holds_nothing(served, point):
    """The client sends a streamed n=2 request with an idempotency key and leaves while the handler is at `point`
    (routing, claiming the key, just admitted): the response is cancelled before its events run. Its choices stop
    generating and leave the engine, its row says disconnected, and the same key is then served at once."""
    server, root = served
    host, port = server.base_url.removeprefix("http://").split(":")
    case, key = f"abandon-{point}", f"abandon-{point}"
    request = ask("slow", case, max_tokens=30, ignore_eos=True, stream=True, n=2, temperature=0.5,
                  metadata={"case": case, "pause": point})
    body = json.dumps(request).encode()
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Idempotency-Key: %s\r\nContent-Length: %d\r\n\r\n" % (key.encode(), len(body)) + body)
        time.sleep(0.3)   # the handler is at `point` (it waits there 1 s)
    deadline = time.monotonic() + 2.5   # a leaked slot stays for good
    while admitted(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert admitted(server) == 0
    logged = wait_rows(root, case)
    assert len(logged) == 2 and all(r["finish_reason"] == "disconnected" and r["completion_tokens"] < 30
                                    for r in logged), logged
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=request,
                      headers={"Idempotency-Key": key}, timeout=60) as again:
        text = "".join(again.iter_text())
    assert again.status_code == 200 and "Idempotent-Replayed" not in again.headers and "[DONE]" in text, text


def test_a_reader_slower_than_the_deadline_is_cut_off_and_logged(served):
    """A client that sends a streamed request and never reads: once the kernel's buffers fill, the server's sends
    block. The deadline (request_timeout_s 4) covers them: the stream is cut off a second after it, the choices
    free their slots and the row says timeout, while the client still holds its socket open."""
    server, root = served
    host, port = server.base_url.removeprefix("http://").split(":")
    body = json.dumps(ask("exp", "slow-reader", max_tokens=400, ignore_eos=True, stream=True, n=16, temperature=0.5,
                          logprobs=True, top_logprobs=20)).encode()   # ~10 MB of events: more than the buffers hold
    conn = socket.socket()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    conn.connect((host, int(port)))
    try:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        start = time.monotonic()
        time.sleep(1)
        while admitted(server) and time.monotonic() - start < 10:
            time.sleep(0.2)
        assert admitted(server) == 0, "a reader that never reads still holds its slots"
        took = time.monotonic() - start
        logged = wait_rows(root, "slow-reader")
        assert len(logged) == 16 and {r["finish_reason"] for r in logged} == {"timeout"}, took
    finally:
        conn.close()


def test_a_spec_naming_its_model_is_checked_off_the_event_loop(served):
    """An inline spec that records the model it was selected on (a fingerprint of its weights) makes the first check
    hash the served model's weights (2 s here, as on a large model): the check runs off the event loop, so /health
    answers meanwhile."""
    server, _ = served
    spec = {"name": "named", "hook": "mlp.act", "factor": 0.5, "units": {"0": [1, 2]},
            "model": {"name": "elsewhere", "fingerprint": "0123456789abcdef", "fingerprint_of": "weights"}}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, server.base_url + "/v1/chat/completions", timeout=60,
                             json={"model": "tiny", "messages": CHAT, "max_tokens": 2, "restraint": spec})
        time.sleep(0.3)
        health = [httpx.get(server.base_url + "/health", timeout=10).elapsed.total_seconds() for _ in range(5)]
        assert answer.result().status_code == 200
    assert max(health) < 0.5, health


def test_n_choices_are_written_together(served):
    server, root = served
    answer = httpx.post(server.base_url + "/v1/chat/completions", json=ask("exp", "n3", n=3, temperature=0.9, seed=1),
                        timeout=60)
    assert answer.status_code == 200
    logged = rows(root, "n3")
    assert [r["id"] for r in logged] == [f"{answer.json()['id']}:{k}" for k in range(3)]
    assert len({r["finished"] for r in logged}) == 1 and {r["finish_reason"] for r in logged} <= {"stop", "length"}


def test_an_idempotent_retry_logs_once_and_replays(served):
    server, root = served
    url = server.base_url + "/v1/chat/completions"
    first = httpx.post(url, json=ask("exp", "idem"), headers={"Idempotency-Key": "k1"}, timeout=60)
    again = httpx.post(url, json=ask("exp", "idem"), headers={"Idempotency-Key": "k1"}, timeout=60)
    assert first.status_code == again.status_code == 200 and again.json() == first.json()
    assert again.headers["Idempotent-Replayed"] == "true" and "Idempotent-Replayed" not in first.headers
    reused = httpx.post(url, json=ask("exp", "idem", max_tokens=3), headers={"Idempotency-Key": "k1"}, timeout=60)
    assert reused.status_code == 422 and reused.json()["error"]["code"] == "idempotency_key_reused"
    assert reused.json()["error"]["param"] == "Idempotency-Key" and len(rows(root, "idem")) == 1

    body = ask("exp", "idem-stream", stream=True, stream_options={"include_usage": True})
    streamed = httpx.post(url, json=body, headers={"Idempotency-Key": "k2"}, timeout=60)
    replayed = httpx.post(url, json=body, headers={"Idempotency-Key": "k2"}, timeout=60)
    assert replayed.headers["Idempotent-Replayed"] == "true" and replayed.text.endswith("data: [DONE]\n\n")

    def content(sse):
        chunks = [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: {")]
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]), chunks[-1]
    (text, usage), (text_again, usage_again) = content(streamed.text), content(replayed.text)
    assert text == text_again and usage["usage"] == usage_again["usage"]
    whole = httpx.post(url, json={**body, "stream": False}, headers={"Idempotency-Key": "k2"}, timeout=60)
    assert whole.json()["choices"][0]["message"]["content"] == text and len(rows(root, "idem-stream")) == 1

    refused = httpx.post(url, json=ask("exp", "idem-4xx", max_tokens=10**6), headers={"Idempotency-Key": "k3"})
    assert refused.status_code == 400   # never reached the engine: the key is free again
    ok = httpx.post(url, json=ask("exp", "idem-4xx"), headers={"Idempotency-Key": "k3"}, timeout=60)
    assert ok.status_code == 200 and "Idempotent-Replayed" not in ok.headers
    too_long = httpx.post(url, json=ask("exp", "idem-long"), headers={"Idempotency-Key": "x" * 256})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "Idempotency-Key"

    slow = ask("slow", "idem-busy", max_tokens=30, ignore_eos=True)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(httpx.post, url, json=slow, headers={"Idempotency-Key": "k4"}, timeout=60)
        time.sleep(0.5)
        busy = httpx.post(url, json=slow, headers={"Idempotency-Key": "k4"}, timeout=60)
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "idempotency_key_in_use"
        assert running.result().status_code == 200
    assert len(rows(root, "idem-busy")) == 1

    left = ask("slow", "idem-left", max_tokens=30, ignore_eos=True)   # the client leaves: 499, logged, key freed
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=left, headers={"Idempotency-Key": "k5"}, timeout=0.5)
    assert [r["finish_reason"] for r in wait_rows(root, "idem-left")] == ["disconnected"]
    retry = httpx.post(url, json=left, headers={"Idempotency-Key": "k5"}, timeout=60)
    assert retry.status_code == 200 and "Idempotent-Replayed" not in retry.headers
    replayed = httpx.post(url, json=left, headers={"Idempotency-Key": "k5"}, timeout=60)
    assert replayed.headers["Idempotent-Replayed"] == "true" and replayed.json() == retry.json()
    assert sorted(r["finish_reason"] for r in rows(root, "idem-left")) == ["disconnected", "length"]


def test_a_failed_step_ends_every_row_of_its_group_at_once(served):
    server, _ = served
    url = server.base_url + "/v1/chat/completions"
    body = {"messages": CHAT, "max_tokens": 8}
    with ThreadPoolExecutor(4) as pool:
        start = time.monotonic()
        boom = pool.submit(httpx.post, url, json={**body, "model": "tiny+boom"}, timeout=60)
        others = [pool.submit(httpx.post, url, json={**body, "model": "tiny"}, timeout=60) for _ in range(3)]
        failed = boom.result()
        answered = [f.result() for f in others]
        took = time.monotonic() - start
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "generation_failed"
    assert failed.json()["error"]["message"] == "generation failed: RuntimeError"   # its text stays in the log
    assert all(r.status_code in (200, 500) for r in answered) and took < 3   # the 504 would come at 4 s
    assert httpx.post(url, json={**body, "model": "tiny"}, timeout=60).status_code == 200


@pytest.mark.parametrize("on_dead", ["serve_others", "exit"])
def test_a_dead_scheduler_refuses_at_once_and_on_engine_dead_applies(model_dirs, tmp_path, ending, on_dead):
    """A transformers engine's scheduler thread ends (an error no step handler catches): the request it held and
    every later one for that model get 503 `engine_dead` at once (not a timeout), /health says engine_dead and the
    other model serves on; with `on_engine_dead: exit` the server drains and exits non-zero. (serve_others: on the
    SIGTERM check's server, whose model g dies there, tiny serving on; exit: model tiny of a server of its own.)"""
    if on_dead == "exit":
        server, dying, other = launch(model_dirs, tmp_path, on_engine_dead="exit", request_timeout_s=30), "tiny", "g"
    else:
        (server, _), dying, other = ending(), "g", "tiny"
    try:
        url = server.base_url + "/v1/chat/completions"
        body = {"messages": CHAT, "max_tokens": 4}
        start = time.monotonic()
        held = httpx.post(url, json={**body, "model": f"{dying}+die"}, timeout=60)
        assert held.status_code == 503 and held.json()["error"]["code"] == "engine_dead", held.text
        assert time.monotonic() - start < 10   # not the request timeout (30 s, 120 s)
        if on_dead == "exit":
            assert server.wait(30) == 1
            assert "error: the engine of model 'tiny' is dead: " in server.logs()
            return
        later = httpx.post(url, json={**body, "model": dying}, timeout=60)
        assert later.status_code == 503 and later.json()["error"]["code"] == "engine_dead"
        assert later.elapsed.total_seconds() < 1
        assert httpx.get(server.base_url + "/health").json()["status"] == "engine_dead"
        assert httpx.post(url, json={**body, "model": other}, timeout=60).status_code == 200
    finally:
        if on_dead == "exit":
            stop_server(server)


def test_a_step_that_does_not_return_reads_stalled(served):
    server, _ = served
    url = server.base_url + "/v1/chat/completions"
    thread = threading.Thread(target=httpx.post, args=(url,), kwargs={"json": {"model": "tiny+stall", "messages": CHAT,
                                                                         "max_tokens": 1}, "timeout": 60})
    thread.start()
    seen = set()
    while thread.is_alive():
        health = httpx.get(server.base_url + "/health").json()
        seen.add((health["status"], health.get("engines", {}).get("tiny", {}).get("state", "ok")))
        time.sleep(0.2)
    assert ("engine_stalled", "stalled") in seen and httpx.get(server.base_url + "/health").json()["status"] == "ok"


def test_sigterm_ends_a_long_stream_within_the_grace_and_logs_it(ending):
    server, root = ending()
    try:
        body = ask("slow", "sigterm", max_tokens=400, ignore_eos=True, stream=True)
        with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body,
                          headers={"Idempotency-Key": "sigterm"}, timeout=60) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if said(line))
            start = time.monotonic()
            server.signal(signal.SIGTERM)
            rest = [line for line in lines if line]
            ended = time.monotonic() - start
        assert server.wait(30) == 0
        took = time.monotonic() - start
    finally:
        stop_server(server)
    assert ended < 2 + 3 and took < 2 + 10, (ended, took)   # the stream at the grace; the process, its teardown after
    assert '"shutting_down"' in rest[-1] and "[DONE]" not in rest
    [row] = rows(root, "sigterm")
    assert row["finish_reason"] == "shutdown" and row["response"]
    with closing(sqlite3.connect(root / "ab.sqlite")) as db:   # 503 shutting_down: its key freed, not stored
        assert db.execute("SELECT COUNT(*) FROM idempotency").fetchone() == (0,)
