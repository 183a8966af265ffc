"""The vllm engine comes back after a crash, for real: one server holds `v` (vLLM) and `t` (the transformers engine)
on the same model. SIGKILL of vLLM's worker during a concurrent burst of `openai` clients, then of vLLM itself:
every request ends (none hangs), those in flight fail cleanly (503 or an error event; experiment ones are logged as
failed), `/health` goes restarting -> ok, and afterwards every greedy reply (registered, late-registered and inline
restraints too) is what it was before. When vLLM cannot start again the engine is dead: with `serve_others` the
other model goes on. (With `on_engine_dead: exit` the server exits non-zero: the same `ServerState.engine_dead` for
every engine, tested on the transformers engine's dead scheduler in test_serve_log.py.)"""

import asyncio
import contextlib
import json
import os
import signal
import stat
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from fixtures import EAGER, served_report
from test_serve_vllm import CHATS, HTTP, INLINE, RESTRAINTS, VLLM, alive, assert_same, descendants, metric

from rolemrc.serve.launch import start_server, stop_server

BURST = 24
BROKEN = "vllm-python: broken on purpose"   # what the wrapper says on stderr when it cannot start vLLM
LENGTH = 400    # tokens each burst request generates (ignore_eos): the kill comes long before the last one
TIMEOUT = 120   # no request may take longer: none hangs


def wrapper(folder: Path) -> tuple[Path, Path]:
    """An interpreter for the engine that runs vLLM's until `broken` exists, then fails at once (a vLLM that
    cannot start again)."""
    broken, script = folder / "broken", folder / "vllm-python"
    script.write_text(f'#!/bin/sh\n[ -e "{broken}" ] && echo "{BROKEN}" >&2 && exit 1\nexec "{VLLM}" "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script, broken


def vllm_process(server, name: str) -> int:
    """The pid of a vLLM process under the server: the API server (`api_server`), or its engine's `VLLM::Worker`
    (or `VLLM::EngineCore` where the engine runs in one process)."""
    found = {}
    for pid in descendants(server.proc.pid):
        try:
            found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
    for marker in ([b"api_server"] if name == "api" else [b"VLLM::Worker", b"VLLM::EngineCore"]):
        pids = [pid for pid, cmd in found.items() if marker in cmd and alive(pid)]
        if pids:
            return min(pids)
    raise AssertionError(f"no {name} process among {found}")


@pytest.fixture(scope="module")
def setup(peaked_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-supervise")
    python, broken = wrapper(root)
    RESTRAINTS["silence"].save(root / "silence.yaml")
    config = {"models": {"v": {"engine": "vllm", "path": str(peaked_model), "python": str(python),
                               "adapter_cache": "lora", "max_model_len": 512, "max_inline_adapters": 2, "memory_utilization": 0.05, "vllm_args": EAGER,
                               "restart_max": 3, "restart_window_s": 3600, "restart_backoff_s": 0.5},
                         "t": {"path": str(peaked_model)}},
              "restraints": {"silence": "silence.yaml"}, "allow_inline_restraints": True, "max_new_tokens": 400,
              "db": "ab.sqlite", "on_engine_dead": "serve_others", "allow_no_auth": True}
    server = start_server(config, workdir=root, timeout=600)
    yield server, broken
    stop_server(server)


@pytest.fixture(scope="module")
def server(setup):
    return setup[0]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def replies(client) -> list:
    """Greedy replies with log-probabilities: unrestrained, a restraint registered at start, one registered while
    serving, an inline one."""
    def ask(model, messages, **extra):
        return client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                              logprobs=True, top_logprobs=3, extra_body=extra or None)

    return [ask(model, messages, **extra) for model, extra in (("v", {}), ("v+silence", {}), ("v+late", {}),
                                                               ("v", {"restraint": INLINE[0]}))
            for messages in CHATS[:2]]


def health(server, http: httpx.Client = HTTP) -> tuple[int, dict]:
    try:
        response = http.get(server.base_url + "/health", timeout=5)
    except httpx.HTTPError:
        return 0, {}
    return response.status_code, response.json()


class Watcher:
    """Polls /health in a thread: the states seen, and when it is ok again."""

    def __init__(self, server) -> None:
        self.server, self.seen, self.ok_at, self.refused = server, [], None, None
        self.http = httpx.Client()   # its own, for its thread
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            _, body = health(self.server, self.http)
            status = body.get("status")
            if not self.seen or self.seen[-1] != status:
                self.seen.append(status)
            if status == "restarting" and self.refused is None:   # what a new request gets meanwhile
                self.refused = self.http.post(self.server.base_url + "/v1/completions", timeout=30,
                                              json={"model": "v", "prompt": "the", "max_tokens": 2, "temperature": 0})
            if status == "ok" and "restarting" in self.seen:
                self.ok_at = time.monotonic()
                return
            time.sleep(0.1)

    def wait(self, timeout: float) -> None:
        self.thread.join(timeout)
        self.stop.set()
        self.thread.join(10)
        self.http.close()


async def burst(server, experiment: str) -> list:
    """BURST long generations at once, streamed and whole, half of them in an A/B experiment; each ends as
    (finish_reason, completion tokens) or its exception."""
    aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)

    async def one(k: int):
        extra = {"ignore_eos": True} | ({"experiment": experiment} if k % 2 else {})
        try:
            if k % 4 < 2:
                whole = await aclient.chat.completions.create(model="v", messages=CHATS[k % 4], max_tokens=LENGTH,
                                                              temperature=0, user=f"u{k}", extra_body=extra)
                return whole.choices[0].finish_reason, whole.usage.completion_tokens
            stream = await aclient.chat.completions.create(model="v", messages=CHATS[k % 4], max_tokens=LENGTH,
                                                           temperature=0, user=f"u{k}", extra_body=extra, stream=True,
                                                           stream_options={"include_usage": True})
            reason, tokens = None, None
            async for c in stream:
                if c.choices and c.choices[0].finish_reason:
                    reason = c.choices[0].finish_reason
                if c.usage:
                    tokens = c.usage.completion_tokens
            return reason, tokens
        except openai.APIError as exc:
            return exc

    return await asyncio.wait_for(asyncio.gather(*[one(k) for k in range(BURST)]), TIMEOUT)


def crash_during_burst(server, client, target: str) -> tuple[list, Watcher, float]:
    """Run a burst, SIGKILL `target` once generation is under way, and wait for the engine to be back."""
    exp = f"crash-{target}"
    arms = [{"name": "a", "model": "v"}, {"name": "b", "model": "v+silence"}]
    assert HTTP.post(server.base_url + "/v1/experiments", json={"id": exp, "arms": arms}).status_code == 201
    pid, engine = vllm_process(server, target), vllm_process(server, "worker")
    results: list = []
    # vLLM generates the whole burst on this model in under a second, sooner than a test can see it running; so its
    # engine is paused while the burst arrives and killed (or its API server is) while still paused: every request is
    # in flight at the kill, whatever the machine's load (resumed first, a loaded machine let it finish the burst)
    os.kill(engine, signal.SIGSTOP)
    runner = threading.Thread(target=lambda: results.extend(asyncio.run(burst(server, exp))))
    runner.start()
    deadline = time.monotonic() + 60
    while metric(server, "rolemrc_inflight ") < BURST + 1:   # + this /metrics call
        assert time.monotonic() < deadline, "the burst never reached the server"
        time.sleep(0.05)
    time.sleep(1)   # and from it, vLLM
    os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):   # the engine, when the API server was the target, runs on
        os.kill(engine, signal.SIGCONT)
    killed = time.monotonic()
    watcher = Watcher(server)
    runner.join(TIMEOUT + 10)
    assert not runner.is_alive(), "a request hung"
    watcher.wait(600)
    assert watcher.ok_at is not None, (watcher.seen, server.logs()[-3000:])
    return results, watcher, watcher.ok_at - killed


def check_burst(results: list, server, exp: str) -> None:
    assert len(results) == BURST
    # an answer is whole or an error: a stream cut by the crash is never passed off as a finished reply
    failed = [r for r in results if isinstance(r, Exception)]
    assert all(r == ("length", LENGTH) for r in results if not isinstance(r, Exception)), results
    assert failed, "no request was in flight at the kill"
    print(f"{len(failed)} of {BURST} requests in flight at the kill failed cleanly")
    for exc in failed:   # in flight at the crash: a clean 503, or an error event in the stream
        assert "is restarting" in str(exc), exc
        assert getattr(exc, "status_code", 503) == 503, exc
    logged = served_report(server, exp)
    in_experiment = [r for k, r in enumerate(results) if k % 2]
    assert logged["requests"] == BURST // 2   # every experiment request is in the A/B log
    assert sum(arm["failed"] for arm in logged["arms"].values()) == sum(isinstance(r, Exception) for r in in_experiment)


def test_worker_sigkill_during_a_burst_restarts_the_engine(server, client):
    made = HTTP.post(server.base_url + "/v1/restraints", json={"name": "late", "spec": {
        "hook": "mlp.act", "factor": 0.0, "units": {"1": list(range(50, 90))}}})
    assert made.status_code == 201
    before = replies(client)
    results, watcher, seconds = crash_during_burst(server, client, "worker")
    print(f"worker SIGKILL -> /health ok in {seconds:.1f} s; states {watcher.seen}")
    check_burst(results, server, "crash-worker")
    assert watcher.seen[-2:] == ["restarting", "ok"], watcher.seen
    refused = watcher.refused
    assert refused is not None and refused.status_code == 503, watcher.seen
    assert refused.json()["error"]["code"] == "engine_restarting" and int(refused.headers["Retry-After"]) >= 1
    assert "127.0.0.1" not in refused.text
    for a, b in zip(replies(client), before):   # the same greedy tokens, adapters restored
        assert_same(a, b)
    assert metric(server, 'rolemrc_engine_restarts_total{model="v"}') == 1
    assert metric(server, 'rolemrc_engine_state{model="v",state="ok"}') == 1


def test_vllm_sigkill_restarts_it_too(server, client):
    before = replies(client)
    results, watcher, seconds = crash_during_burst(server, client, "api")
    print(f"vLLM SIGKILL -> /health ok in {seconds:.1f} s; states {watcher.seen}")
    check_burst(results, server, "crash-api")
    for a, b in zip(replies(client), before):
        assert_same(a, b)
    assert metric(server, 'rolemrc_engine_restarts_total{model="v"}') == 2


def test_an_engine_that_cannot_start_again_is_dead_and_the_others_serve_on(setup, client):
    """Runs after the restarts above: restart_max 3 within the window, so the third crash's failed restart is the
    last straw."""
    server, broken = setup
    broken.touch()
    os.kill(vllm_process(server, "api"), signal.SIGKILL)
    deadline = time.monotonic() + 120
    while health(server)[1].get("status") != "engine_dead" and time.monotonic() < deadline:
        time.sleep(0.2)
    code, body = health(server)
    assert body["status"] == "engine_dead" and body["engines"]["v"]["state"] == "dead", body
    assert BROKEN in json.dumps(body), body   # why: the last line vLLM's interpreter printed on stderr
    assert code == 200   # `t` still answers
    with pytest.raises(openai.InternalServerError) as refused:
        client.chat.completions.create(model="v", messages=CHATS[0], max_tokens=4, temperature=0)
    assert refused.value.status_code == 503 and refused.value.body["code"] == "engine_dead"
    assert client.chat.completions.create(model="t", messages=CHATS[0], max_tokens=4, temperature=0).choices
    assert server.proc.poll() is None
    assert metric(server, 'rolemrc_engine_state{model="v",state="dead"}') == 1

