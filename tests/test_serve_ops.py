"""Operations over real HTTP: queue full (429), graceful drain (503, in-flight finishes), timeout (504), bounded load
through an experiment (zero 5xx, each request logged once), SIGKILL mid-load (nothing acknowledged lost). Three server
processes, each ended by what its test checks: a job's (504s, then the job is killed), the load's (schemathesis, the
load, then SIGKILL) and the restart's on the load's database (the log read back, a full queue, then SIGTERM)."""

import asyncio
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from rolemrc.serve.launch import running_server, start_server, stop_server

CHAT = [{"role": "user", "content": "the keeper of the lighthouse"}]


def long_stream(base_url):
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 400, "stream": True, "ignore_eos": True}
    return httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60)


def check_queue_full_then_drain_on_sigterm(server):
    """A server with max_queue 1 and max_batch 1: a second request while a long stream runs is 429 queue_full; on
    SIGTERM /health says draining, new requests are 503 shutting_down, the running stream still finishes and the
    server exits 0."""
    with long_stream(server.base_url) as first:
        lines = first.iter_lines()
        next(lines)
        busy = httpx.post(server.base_url + "/v1/chat/completions", json={"model": "tiny", "messages": CHAT})
        assert busy.status_code == 429 and busy.json()["error"]["code"] == "queue_full"
        server.signal(signal.SIGTERM)          # drain: the running stream must still finish
        for _ in range(50):
            health = httpx.get(server.base_url + "/health")
            if health.status_code == 503:
                break
        assert health.json()["status"] == "draining"
        refused = httpx.post(server.base_url + "/v1/chat/completions", json={"model": "tiny", "messages": CHAT})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in "\n".join(rest)
    assert server.wait(30) == 0


def check_504_and_the_server_carries_on(base_url):
    """request_timeout_s 0.3 (400 decode steps take seconds on any machine): 504 timeout, then a one-token request
    is answered."""
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 400, "ignore_eos": True}
    slow = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60)
    assert slow.status_code == 504 and slow.json()["error"]["code"] == "timeout"
    for _ in range(5):   # one token fits in 0.3 s, though a machine busy with other work may need a retry
        quick = httpx.post(base_url + "/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=60)
        if quick.status_code != 504:
            break
    assert quick.status_code == 200 and quick.json()["usage"]["completion_tokens"] == 1


def test_over_its_time_limit_504_then_a_server_started_for_a_job_dies_with_the_job(model_dirs, tmp_path):
    """A server a job started (a sweep, a notebook; here `python -c`) with request_timeout_s 0.3 answers a request
    over its time limit with 504 and carries on; then the job is SIGKILLed and leaves no server behind: the server
    gets SIGTERM and exits."""
    config = {"models": {"tiny": {"path": str(model_dirs["llama"])}}, "max_new_tokens": 400, "db": None,
              "request_timeout_s": 0.3}
    job = textwrap.dedent(f"""
        import time
        from rolemrc.serve.launch import start_server
        server = start_server({config!r}, workdir={str(tmp_path)!r})
        print(server.proc.pid, server.base_url, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", job], stdout=subprocess.PIPE, text=True)
    try:
        pid, base_url = proc.stdout.readline().split()
        check_504_and_the_server_carries_on(base_url)
    finally:
        proc.kill()
        proc.wait()
    stat = Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + 60
    while stat.exists() and stat.read_text().split(") ")[1][0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not stat.exists() or stat.read_text().split(") ")[1][0] == "Z", "the server outlived its job"


async def fire(base_url, n, concurrency, acked, statuses, on_progress=None, offset=0):
    """n experiment requests at the given concurrency; `acked` collects ids of complete 200 responses."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        async def one(k):
            async with sem:
                body = {"model": "ab", "messages": [{"role": "user", "content": f"the keeper {k} of the lighthouse"}],
                        "max_tokens": 4, "temperature": 0.8, "seed": k, "user": f"user{k % 37}",
                        "experiment": "load", "metadata": {"k": k}}
                try:
                    r = await client.post("/v1/chat/completions", json=body)
                except httpx.HTTPError:
                    statuses.append("conn")
                    return
                statuses.append(r.status_code)
                if r.status_code == 200:
                    acked.append(r.json()["id"])
                    if on_progress:
                        on_progress(len(acked))
        await asyncio.gather(*(one(k) for k in range(offset, offset + n)))


def logged(db):
    with sqlite3.connect(db) as conn:
        return [row[0] for row in conn.execute("SELECT id FROM requests WHERE experiment = 'load'")]


@pytest.fixture(scope="module")
def load_server(model_dirs, tmp_path_factory):
    """`load_server()`: (server, folder) of the server schemathesis and the load test share (the load test ends it
    with SIGKILL): its limits are the load's (max_batch 16, max_queue 64), its token and inline-spec limits
    schemathesis's. Started at the first call, and again, in a fresh folder, at a call that finds it exited."""
    started = []

    def get():
        if not started or started[-1][0].proc.poll() is not None:
            root = tmp_path_factory.mktemp("serve-ops-load")
            config = {"models": {"tiny": {"path": str(model_dirs["llama"])}}, "db": "ab.sqlite", "restraints": {},
                      "max_batch": 16, "max_queue": 64, "max_new_tokens": 16, "default_max_tokens": 4,
                      "allow_inline_restraints": True, "max_inline_units": 64, "allow_no_auth": True}
            started.append((start_server(config, workdir=root), root))
        return started[-1]
    yield get
    for server, _ in started:
        stop_server(server)


@pytest.mark.slow
def test_schemathesis_finds_no_server_errors(load_server, tmp_path):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.configuration import set_hypothesis_home_dir
    from schemathesis.checks import not_a_server_error

    set_hypothesis_home_dir(tmp_path / "hypothesis")   # its caches, not a .hypothesis/ in the checkout
    server, _ = load_server()
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    failures, calls = [], []
    for op in schema.get_all_operations():
        operation = op.ok()

        @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(case=operation.as_strategy())
        def run(case):
            response = case.call(base_url=server.base_url, timeout=30)
            calls.append(response.status_code)
            try:
                case.validate_response(response, checks=[not_a_server_error])
            except Exception as exc:  # collect all, report together
                failures.append(f"{operation.label}: {exc}"[:500])  # noqa: B023 (run() is called below)
        run()
    assert not failures, "\n".join(failures[:5])
    assert len(calls) >= 60 and {200, 201} & set(calls) and any(400 <= c < 500 for c in calls)
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_load_through_experiment_then_sigkill_loses_nothing_acknowledged_then_a_restart_drains(load_server, model_dirs):
    """320 requests through an experiment: all 200, each logged once, arms weighted; SIGKILL mid-load: every
    acknowledged request is in the log, which a restarted server reads back. The restart (max_queue 1, max_batch 1)
    then checks a full queue and the drain on SIGTERM (`check_queue_full_then_drain_on_sigterm`)."""
    server, root = load_server()
    db = root / "ab.sqlite"
    try:
        arms = [{"name": "a", "model": "tiny", "weight": 2}, {"name": "b", "model": "tiny", "weight": 1}]
        assert httpx.post(server.base_url + "/v1/experiments", json={"id": "load", "arms": arms}).status_code == 201
        acked, statuses = [], []
        asyncio.run(fire(server.base_url, 320, 16, acked, statuses))
        assert statuses.count(200) == 320 and not [s for s in statuses if s != 200]
        ids = logged(db)
        assert len(ids) == len(set(ids)) == 320 and set(ids) == set(acked)
        counts = httpx.get(server.base_url + "/v1/experiments/load").json()["requests"]
        assert counts["a"] > counts["b"] > 0

        acked, statuses = [], []
        killed = threading.Event()

        def kill_at(n):
            if n >= 60 and not killed.is_set():
                killed.set()
                server.proc.kill()
        asyncio.run(fire(server.base_url, 400, 16, acked, statuses, on_progress=kill_at, offset=1000))
        assert killed.is_set() and server.wait(10) == -signal.SIGKILL
    finally:
        stop_server(server)
    assert "conn" in statuses   # requests were cut off by the kill
    config = {"models": {"tiny": {"path": str(model_dirs["llama"])}}, "db": "ab.sqlite", "allow_no_auth": True,
              "max_queue": 1, "max_batch": 1, "max_new_tokens": 400, "shutdown_grace_s": 30}
    with running_server(config, workdir=root) as server:   # restart on the same database
        ids = set(logged(db))
        assert set(acked) <= ids and len(acked) >= 60
        total = sum(httpx.get(server.base_url + "/v1/experiments/load").json()["requests"].values())
        assert total == len(ids) >= 320 + len(acked)
        check_queue_full_then_drain_on_sigterm(server)
