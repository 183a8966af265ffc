"""Two `rolemrc serve` replicas sharing one real PostgreSQL server, over real HTTP: a restraint registered on one is
served by the other; 200 experiment requests round-robin from 40 users keep each user's arm on both replicas, log
every request id once and keep arm_counts equal to the rows; SIGKILL of one replica mid-load loses no acknowledged
row. Restraints agree across replicas: a DELETE, or a name deleted and registered again with other units, reaches the
other replica within RESTRAINTS_STALE_S; of two concurrent registrations of one name the database picks one. One pair
of replicas for the module: the load test, last, SIGKILLs one of them."""

import asyncio
import signal
import statistics
import time
from contextlib import closing

import httpx
import pytest
from fixtures import postgres_database

from rolemrc.serve.launch import start_server, stop_server
from rolemrc.serve.state import RESTRAINTS_STALE_S
from rolemrc.serve.store import Store

USERS = 40
MUTE = {"hook": "mlp.act", "factor": 0.0, "units": {"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]}}
LOUD = {"hook": "mlp.act", "factor": 6.0, "units": {"0": list(range(48)), "1": list(range(48))}}
MARGIN_S = 1.0   # how long past the bound the tests keep asking, to see nothing stale is served after it


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


class Pair:
    """Two replicas of the tiny model on one PostgreSQL database (`db`), shared by the module's tests (each its own
    names and experiment). Calling it gives both, started again where a test ended one (the load test SIGKILLs
    replica b), so the tests may run in any order."""

    def __init__(self, config, folders):
        self.config, self.folders, self.servers = config, folders, [None, None]
        self.db = config["db"]

    def __call__(self):
        for k, server in enumerate(self.servers):
            if server is None or server.proc.poll() is not None:
                self.servers[k] = start_server(self.config, workdir=self.folders[k])
        return tuple(self.servers)

    def stop(self):
        for server in self.servers:
            if server is not None:
                stop_server(server)


@pytest.fixture(scope="module")
def pair(model_dirs, tmp_path_factory, postgres):
    config = {"models": {"tiny": {"path": str(model_dirs["llama"])}}, "db": postgres_database(postgres),
              "max_batch": 16, "max_queue": 64, "allow_inline_restraints": True, "allow_no_auth": True}
    replicas = Pair(config, [tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")])
    try:
        yield replicas
    finally:
        replicas.stop()


@pytest.fixture
def replicas(pair):
    return pair()


def ask(replica, model):
    """One greedy token from `model` on `replica`: (status, error code or None, its top-5 logprobs by token)."""
    r = httpx.post(replica.base_url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "the keeper of the lighthouse"}], "max_tokens": 1,
        "temperature": 0, "logprobs": True, "top_logprobs": 5})
    if r.status_code != 200:
        return r.status_code, r.json()["error"]["code"], None
    top = r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    return 200, None, {t["token"]: t["logprob"] for t in top}


def same(x, y):
    return x is not None and y is not None and x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-3 for t in x)


def poll(replica, model, since):
    """`ask` repeatedly until MARGIN_S past the bound after `since` (time.monotonic(), the clock the servers' bound
    is kept on; and at least twice after the bound): the answers to the requests sent after the bound."""
    late = []
    while (sent := time.monotonic()) < since + RESTRAINTS_STALE_S + MARGIN_S or len(late) < 2:
        answer = ask(replica, model)
        if sent > since + RESTRAINTS_STALE_S:
            late.append(answer)
        time.sleep(0.05)
    return late


def card(replica, name):
    listed = {c["name"]: c for c in httpx.get(replica.base_url + "/v1/restraints").json()["data"]}
    return listed.get(name)


def test_a_delete_on_one_replica_reaches_the_other_within_the_bound(replicas):
    a, b = replicas
    assert httpx.post(a.base_url + "/v1/restraints", json={"name": "gone", "spec": MUTE}).status_code == 201
    assert ask(b, "tiny+gone")[0] == 200   # B has learnt it
    assert httpx.delete(a.base_url + "/v1/restraints/gone").status_code == 204
    deleted = time.monotonic()
    late = poll(b, "tiny+gone", deleted)
    assert all(answer[:2] == (404, "restraint_not_found") for answer in late), late
    refused = httpx.post(b.base_url + "/v1/chat/completions", json={
        "model": "tiny", "restraint": "gone", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "restraint_not_found"
    assert card(b, "gone") is None
    assert httpx.delete(b.base_url + "/v1/restraints/gone").status_code == 404   # gone on every replica

    assert httpx.post(a.base_url + "/v1/restraints", json={"name": "gone", "spec": MUTE}).status_code == 201
    assert ask(a, "tiny+gone")[0] == 200
    assert httpx.delete(b.base_url + "/v1/restraints/gone").status_code == 204   # B never served it: the store's
    late = poll(a, "tiny+gone", time.monotonic())
    assert all(answer[:2] == (404, "restraint_not_found") for answer in late), late

    assert httpx.post(a.base_url + "/v1/restraints", json={"name": "kept", "spec": MUTE}).status_code == 201
    arms = [{"name": "plain", "model": "tiny"}, {"name": "kept", "model": "tiny", "restraint": "kept"}]
    assert httpx.post(a.base_url + "/v1/experiments", json={"id": "keeps", "arms": arms}).status_code == 201
    in_use = httpx.delete(b.base_url + "/v1/restraints/kept")
    assert in_use.status_code == 409 and in_use.json()["error"]["code"] == "restraint_in_use"


def test_a_name_registered_again_with_other_units_is_served_with_them_on_every_replica(replicas):
    a, b = replicas
    assert httpx.post(a.base_url + "/v1/restraints", json={"name": "swap", "spec": MUTE}).status_code == 201
    status, _, old = ask(b, "tiny+swap")
    assert status == 200 and same(old, ask(a, "tiny+swap")[2])
    assert httpx.delete(a.base_url + "/v1/restraints/swap").status_code == 204
    assert httpx.post(a.base_url + "/v1/restraints", json={"name": "swap", "spec": LOUD}).status_code == 201
    changed = time.monotonic()
    new = ask(a, "tiny+swap")[2]
    assert not same(old, new)   # the two versions answer differently
    late = poll(b, "tiny+swap", changed)
    assert all(status == 200 and same(top, new) for status, _, top in late), (new, late)
    assert card(b, "swap")["spec"]["units"] == LOUD["units"] and card(b, "swap")["spec"]["factor"] == LOUD["factor"]


def test_concurrent_registrations_of_one_name_on_two_replicas_one_wins(replicas):
    a, b = replicas

    async def register(name):
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(client.post(a.base_url + "/v1/restraints", json={"name": name, "spec": MUTE}),
                                        client.post(b.base_url + "/v1/restraints", json={"name": name, "spec": LOUD}))

    for k in range(4):
        name = f"race{k}"
        on_a, on_b = asyncio.run(register(name))
        assert sorted([on_a.status_code, on_b.status_code]) == [201, 409], (on_a.text, on_b.text)
        loser = on_b if on_a.status_code == 201 else on_a
        assert loser.json()["error"]["code"] == "restraint_exists"
        won = MUTE if on_a.status_code == 201 else LOUD
        served_a, served_b = ask(a, f"tiny+{name}"), ask(b, f"tiny+{name}")
        assert served_a[0] == served_b[0] == 200 and same(served_a[2], served_b[2])
        for replica in (a, b):
            assert card(replica, name)["spec"]["units"] == won["units"]


def test_two_replicas_share_restraints_experiments_and_the_log(pair, replicas):
    """Last of the module's tests: it SIGKILLs replica b."""
    a, b = replicas
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
    with closing(Store.open(pair.db)) as store:
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
