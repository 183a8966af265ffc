"""Two `rolemrc serve` replicas sharing one real PostgreSQL server, over real HTTP: a restraint registered on one is
served by the other; 200 experiment requests round-robin from 40 users keep each user's arm on both replicas, log
every request id once and keep arm_counts equal to the rows; SIGKILL of one replica mid-load loses no acknowledged
row."""

import asyncio
import signal
import statistics
import time
from contextlib import closing

import httpx

from rolemrc.serve.launch import start_server, stop_server
from rolemrc.serve.store import Store

USERS = 40
MUTE = {"hook": "mlp.act", "factor": 0.0, "units": {"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]}}


async def load(urls, n, offset, results, on_ack=None):
    """n experiment requests sent round-robin to `urls` (16 at a time); `results` gets (id or status, seconds, arm,
    user) per request; "conn" when the connection broke."""
    sem = asyncio.Semaphore(16)
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(k):
            user = f"user{k % USERS}"
            body = {"model": "ab", "messages": [{"role": "user", "content": f"the keeper {k} of the lighthouse"}],
                    "max_tokens": 4, "temperature": 0.8, "seed": k, "user": user, "experiment": "shared"}
            async with sem:
                start = time.perf_counter()
                try:
                    r = await client.post(urls[k % len(urls)] + "/v1/chat/completions", json=body)
                except httpx.HTTPError:
                    results.append(("conn", None, None, user))
                    return
                took = time.perf_counter() - start
                if r.status_code != 200:
                    results.append((r.status_code, took, None, user))
                    return
                results.append((r.json()["id"], took, r.json()["arm"], user))
                if on_ack:
                    on_ack(sum(1 for x in results if x[2] is not None))
        await asyncio.gather(*(one(k) for k in range(offset, offset + n)))


def test_two_replicas_share_restraints_experiments_and_the_log(model_dirs, tmp_path, postgres_url):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    config = {"models": {"tiny": {"path": str(model_dirs["llama"])}}, "db": postgres_url, "max_batch": 16,
              "max_queue": 64, "allow_inline_restraints": True}
    a = start_server(config, workdir=tmp_path / "a")
    b = start_server(config, workdir=tmp_path / "b")
    try:
        made = httpx.post(a.base_url + "/v1/restraints", json={"name": "mute", "spec": MUTE})
        assert made.status_code == 201
        chat = {"model": "tiny+mute", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        served = httpx.post(b.base_url + "/v1/chat/completions", json=chat, timeout=60)
        assert served.status_code == 200 and served.json()["restraint"] == "mute"
        other = httpx.post(b.base_url + "/v1/restraints", json={"name": "mute", "spec": {**MUTE, "factor": 0.5}})
        assert other.status_code == 409   # the name holds another restraint on every replica

        arms = [{"name": "plain", "model": "tiny"}, {"name": "muted", "model": "tiny", "restraint": "mute"}]
        assert httpx.post(b.base_url + "/v1/experiments", json={"id": "shared", "arms": arms}).status_code == 201

        results = []
        start = time.perf_counter()
        asyncio.run(load([a.base_url, b.base_url], 200, 0, results))
        seconds = time.perf_counter() - start
        acked = [r for r in results if r[2] is not None]
        assert len(acked) == 200, [r for r in results if r[2] is None][:5]
        arm_of = {}
        for _, _, arm, user in acked:   # sticky: a user's arm is the same on both replicas
            assert arm_of.setdefault(user, arm) == arm
        assert set(arm_of.values()) == {"plain", "muted"}
        with closing(Store.open(postgres_url)) as store:
            rows = store.requests("shared")
            ids = [r["id"] for r in rows]
            assert len(ids) == len(set(ids)) == 200 and set(ids) == {r[0] for r in acked}
            assert all(arm_of[r["user"]] == r["arm"] for r in rows)
            per_arm = {arm: sum(r["arm"] == arm for r in rows) for arm in ("plain", "muted")}
            for replica in (a, b):
                assert httpx.get(replica.base_url + "/v1/experiments/shared").json()["requests"] == per_arm
            p50 = statistics.median(r[1] for r in acked)
            print(f"\ntwo replicas: {len(results)} requests, {len(rows)} rows, {seconds:.1f} s, p50 {p50 * 1000:.0f} ms")

            results.clear()

            def kill_b(n):
                if n >= 40 and b.proc.poll() is None:
                    b.proc.kill()
            asyncio.run(load([a.base_url, b.base_url], 200, 1000, results, on_ack=kill_b))
            assert b.wait(10) == -signal.SIGKILL and "conn" in [r[0] for r in results]
            acked = {r[0] for r in results if r[2] is not None}
            rows = store.requests("shared")
            ids = [r["id"] for r in rows]
            assert len(ids) == len(set(ids)) and acked <= set(ids) and len(ids) >= 200 + len(acked)
            assert store.arm_counts("shared") == {arm: sum(r["arm"] == arm for r in rows) for arm in ("muted", "plain")}
            print(f"SIGKILL of one replica: {len(results)} requests, {len(acked)} acknowledged, all logged; "
                  f"{len(ids) - 200 - len(acked)} logged but cut off before the answer")
    finally:
        stop_server(a)
        stop_server(b)
