"""The A/B store on SQLite and on a real PostgreSQL server: every method on both, atomic claims, one transaction
per request, migration of a log written by the first schema, and a full or locked database answered with coded 503s
over real HTTP (never a 200 without its row)."""

import asyncio
import json
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import httpx
import psycopg
import pytest

from rolemrc.serve.launch import free_port, launch_server, running_server
from rolemrc.serve.store import Claim, Store, StoreError
from rolemrc.serve.store.backend import HEALTH_TTL_S
from rolemrc.serve.store.schema import MIGRATIONS, VERSION

ARMS = [{"name": "a", "model": "tiny", "weight": 1}, {"name": "b", "model": "tiny", "weight": 1}]
RUNNING = {"status": "running", "body": "body", "response": None}   # a claim of the body hashed "body", held
# the schema the first release wrote (commit 9a34e99), without schema_version
OLD_SCHEMA = """
CREATE TABLE IF NOT EXISTS experiments (
  id TEXT PRIMARY KEY, description TEXT NOT NULL, arms TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS requests (
  id TEXT PRIMARY KEY, experiment TEXT NOT NULL REFERENCES experiments(id), arm TEXT NOT NULL, user TEXT,
  model TEXT NOT NULL, restraint TEXT, endpoint TEXT NOT NULL, messages TEXT NOT NULL, response TEXT NOT NULL,
  finish_reason TEXT, latency_s REAL NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
  metadata TEXT, started REAL NOT NULL, finished REAL NOT NULL);
CREATE INDEX IF NOT EXISTS requests_by_experiment ON requests(experiment, arm);
CREATE TABLE IF NOT EXISTS restraints (name TEXT PRIMARY KEY, spec TEXT NOT NULL, created REAL NOT NULL);
"""


def row(rid, arm="a", exp="e1", **kw):
    return {"id": rid, "request_id": rid.split(":")[0], "experiment": exp, "arm": arm, "user": "u1", "model": "tiny",
            "endpoint": "chat", "messages": [{"role": "user", "content": "hi"}], "response": "hello",
            "finish_reason": "stop", "latency_s": 0.5, "prompt_tokens": 3, "completion_tokens": 2,
            "metadata": {"reference": "hello"}, "started": time.time(), "finished": time.time()} | kw


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path):
    """The `db` setting of a fresh database on each backend."""
    return str(tmp_path / "ab.sqlite") if request.param == "sqlite" else request.getfixturevalue("postgres_url")


def test_every_method_on_both_backends(db):
    with closing(Store.open(db)) as store:
        assert store.add_experiment("e1", "first", ARMS, 1.5) and not store.add_experiment("e1", "again", [], 2.0)
        assert store.experiment("e1") == {"id": "e1", "description": "first", "arms": ARMS, "created": 1.5,
                                          "reveal_arm": True}
        assert store.experiment("nope") is None and store.arm_counts("e1") == {}

        first = store.claim("e1", "c1", "k1", "body")
        assert isinstance(first, Claim) and first[:3] == ("e1", "c1", "k1")
        assert store.claim("e1", "c1", "k1", "body") == RUNNING
        assert store.claim("e1", "c1", "k1", "body", stale_after_s=3600) == RUNNING
        assert store.claim("e1", "c1", "k1", "other", stale_after_s=0) == RUNNING   # another body never takes over
        held = store.claim("e1", "c1", "k1", "body", stale_after_s=0)   # its replica died: taken over, new token
        assert isinstance(held, Claim) and held.token != first.token
        assert isinstance(store.claim("e1", "c2", "k1", "body"), Claim)   # another caller's key of the same name
        assert store.log_request([row("r1:0"), row("r1:1", error="boom", finish_reason="error")], held, {"id": "r1"})
        assert store.claim("e1", "c1", "k1", "body") == {"status": "done", "body": "body", "response": {"id": "r1"}}
        store.log_request([row("r2", arm="b", user=None, metadata=None, response="a\x00b")])
        assert store.arm_counts("e1") == {"a": 2, "b": 1}
        rows = store.requests("e1")
        assert [r["id"] for r in rows] == ["r1:0", "r1:1", "r2"] and {r["request_id"] for r in rows} == {"r1", "r2"}
        assert rows[0]["messages"] == [{"role": "user", "content": "hi"}] and rows[0]["metadata"]["reference"] == "hello"
        assert rows[1]["error"] == "boom" and rows[2]["user"] is None and rows[2]["metadata"] is None
        assert rows[2]["response"] == "a\ufffdb"   # as PostgreSQL can store it, on both backends

        k2 = store.claim("e1", "c1", "k2", "body")
        store.release_claim(k2)
        assert isinstance(store.claim("e1", "c1", "k2", "other"), Claim)   # released: a retry runs, any body
        store.release_claim(held)                                          # a done key stays
        assert store.claim("e1", "c1", "k1", "body")["status"] == "done"
        k3 = store.claim("e1", "c1", "k3", "body")
        assert store.log_request([row("r3", response="", finish_reason="timeout")], k3, None)   # not final: freed
        assert isinstance(store.claim("e1", "c1", "k3", "body"), Claim)

        spec = {"name": "mute", "hook": "mlp.act", "factor": 0.0, "units": {"0": [1, 2]}}
        store.add_restraint("mute", spec, 1.0)
        store.add_restraint("mute", {**spec, "factor": 0.5}, 2.0)   # the first spec under a name stays
        store.add_restraint("loud", {**spec, "name": "loud"}, 3.0)
        assert store.restraint("mute") == spec and store.restraint("nope") is None
        assert list(store.restraints()) == ["mute", "loud"]
        assert store.delete_restraint("mute") and not store.delete_restraint("mute")
        assert list(store.restraints()) == ["loud"]
        assert store.health() is None
    with closing(Store.open(db)) as store:   # reopened: migrations are not run twice, nothing lost
        assert store.arm_counts("e1") == {"a": 3, "b": 1} and len(store.requests("e1")) == 4
        assert store.delete_experiment("e1") and not store.delete_experiment("e1")
        assert store.experiment("e1") is None and store.requests("e1") == [] and store.arm_counts("e1") == {}
        assert isinstance(store.claim("e1", "c1", "k1", "other"), Claim)   # its keys went too
        with store.backend.transaction() as tx:
            assert tx.execute("SELECT version FROM schema_version") == [{"version": VERSION}]


def test_rows_of_a_request_commit_together_or_not_at_all(db):
    with closing(Store.open(db)) as store:
        store.add_experiment("e1", "", ARMS, 1.0)
        store.log_request([row("r1")])
        with pytest.raises((sqlite3.IntegrityError, psycopg.IntegrityError)):   # a repeated id: all rolled back
            store.log_request([row("r2"), row("r1")], store.claim("e1", "c", "k", "body"), {"id": "r2"})
        assert [r["id"] for r in store.requests("e1")] == ["r1"] and store.arm_counts("e1") == {"a": 1}
        assert store.claim("e1", "c", "k", "body") == RUNNING   # still held by the request whose commit failed


def test_stores_opened_at_once_migrate_once_and_claim_a_key_once(db):
    with ThreadPoolExecutor(8) as pool:   # each its own connection, as replicas have; all migrate the new database
        stores = list(pool.map(lambda _: Store.open(db), range(8)))
    try:
        stores[0].add_experiment("e1", "", ARMS, 1.0)
        results, barrier = [], threading.Barrier(len(stores))

        def claim(store):
            barrier.wait()
            results.append(store.claim("e1", "c", "same-key", "body"))
        threads = [threading.Thread(target=claim, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(isinstance(r, Claim) for r in results) == 1 and results.count(RUNNING) == 7
    finally:
        for store in stores:
            store.close()


def test_a_taken_over_claim_is_fenced_out_of_the_key_but_its_rows_are_logged(db):
    """Two replicas hold one key in turn: the first is taken over as stale while it still runs. Its commit (a final
    answer or a failure that would free the key) neither overwrites nor frees the key of the request that took it
    over; its rows are logged all the same, since it ran."""
    with closing(Store.open(db)) as store:
        store.add_experiment("e1", "", ARMS, 1.0)
        first = store.claim("e1", "c", "k", "body")
        second = store.claim("e1", "c", "k", "body", stale_after_s=0)
        assert isinstance(second, Claim) and second.token != first.token
        assert not store.log_request([row("r1")], first, {"id": "r1"})   # fenced out: the key is not settled
        assert not store.log_request([row("r1b")], first, None)
        store.release_claim(first)
        assert store.claim("e1", "c", "k", "body") == RUNNING             # still the second's
        assert store.log_request([row("r2")], second, {"id": "r2"})
        assert not store.log_request([row("r1c")], first, {"id": "r1"})   # a late commit after the second's
        assert store.claim("e1", "c", "k", "body") == {"status": "done", "body": "body", "response": {"id": "r2"}}
        assert [r["id"] for r in store.requests("e1")] == ["r1", "r1b", "r2", "r1c"]
        assert store.arm_counts("e1") == {"a": 4}


class RefusingStore(Store):
    """A store whose request log refuses every write, as a full disk would; the rest of it answers."""

    def log_request(self, rows, claim=None, response=None):
        raise StoreError("db_full", "the log cannot take the write (db_full)")


def test_a_commit_the_database_refused_frees_the_key(db):
    from rolemrc.serve import outcome
    from rolemrc.serve.errors import ApiError

    with closing(RefusingStore.open(db)) as store:
        store.add_experiment("e1", "", ARMS, 1.0)
        held = store.claim("e1", "c", "k", "body")
        with pytest.raises(ApiError) as refused:
            asyncio.run(outcome.write(store, [row("r1")], held, {"id": "r1"}))
        assert refused.value.status == 503 and refused.value.code == "db_full"
        assert isinstance(store.claim("e1", "c", "k", "body"), Claim)   # the retry runs now, no 409 for the stale window
        assert store.requests("e1") == []


def test_a_restraint_name_holds_one_version_and_every_change_moves_the_generation(db):
    spec = {"name": "mute", "hook": "mlp.act", "factor": 0.0, "units": {"0": [1, 2]}}
    other = {**spec, "factor": 0.5}
    with closing(Store.open(db)) as store:
        g0, versions = store.restraint_versions()
        assert versions == {} and store.restraint_versions(g0) == (g0, None)   # unchanged: one single-row read
        new, v1, held = store.add_restraint("mute", spec, 1.0)
        assert new and held == spec
        assert store.add_restraint("mute", other, 2.0) == (False, v1, spec)   # the name keeps its first spec
        g1, versions = store.restraint_versions(g0)
        assert g1 > g0 and versions == {"mute": v1} and store.restraint_versions(g1) == (g1, None)
        assert not store.delete_restraint("mute", v1 + 1) and store.restraint_versions(g1) == (g1, None)
        assert store.delete_restraint("mute", v1)
        g2, versions = store.restraint_versions(g1)
        assert g2 > g1 and versions == {}
        new, v2, _ = store.add_restraint("mute", other, 3.0)   # deleted, then registered again: a new version
        assert new and v2 > v1 and store.versioned_restraint("mute") == (v2, other)
        assert store.versioned_restraints() == (store.restraint_versions()[0], {"mute": (v2, other)})


def test_concurrent_registrations_of_one_name_keep_one(db):
    with ThreadPoolExecutor(6) as pool:
        stores = list(pool.map(lambda _: Store.open(db), range(6)))
    try:
        results, barrier = [], threading.Barrier(len(stores))

        def register(k, store):
            barrier.wait()
            results.append(store.add_restraint("race", {"name": "race", "factor": float(k)}, time.time()))
        threads = [threading.Thread(target=register, args=(k, s)) for k, s in enumerate(stores)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        won = [r for r in results if r[0]]
        assert len(won) == 1 and all(r[1:] == won[0][1:] for r in results)   # the losers are told the winner's
        assert stores[0].restraint("race") == won[0][2]
    finally:
        for store in stores:
            store.close()


def test_keys_of_the_version_2_schema_are_dropped_and_rows_kept(tmp_path):
    path = tmp_path / "ab.sqlite"
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        for statement in (*MIGRATIONS[0], *MIGRATIONS[1]):
            conn.execute(statement)
        conn.execute("INSERT INTO schema_version VALUES (2)")
        conn.execute("INSERT INTO experiments VALUES ('e1', '', '[]', 1.0)")
        conn.execute("INSERT INTO idempotency VALUES ('e1', 'k', 'done', '{\"error\": {}}', 1.0)")
    with closing(Store.open(str(path))) as store:
        store.log_request([row("r1")])
        assert isinstance(store.claim("e1", "c", "k", "body"), Claim) and len(store.requests("e1")) == 1
        with store.backend.transaction() as tx:
            assert tx.execute("SELECT version FROM schema_version") == [{"version": VERSION}]


def test_a_log_written_by_the_first_schema_migrates(tmp_path):
    path = tmp_path / "ab.sqlite"
    with sqlite3.connect(path) as conn:
        conn.executescript(OLD_SCHEMA)
        conn.execute("INSERT INTO experiments VALUES ('old', 'kept', '[]', 1.0)")
        for k, arm in enumerate("aab"):
            conn.execute("INSERT INTO requests (id, experiment, arm, user, model, endpoint, messages, response, "
                         "latency_s, prompt_tokens, completion_tokens, started, finished) "
                         "VALUES (?, 'old', ?, 'u', 'tiny', 'chat', '[]', 'x', 0.1, 1, 1, ?, ?)", (f"r{k}", arm, k, k))
        conn.execute("INSERT INTO restraints VALUES ('mute', '{\"name\": \"mute\"}', 1.0)")
    with closing(Store.open(str(path))) as store:
        assert store.arm_counts("old") == {"a": 2, "b": 1} and store.versioned_restraint("mute") == (0, {"name": "mute"})
        assert [(r["id"], r["request_id"]) for r in store.requests("old")] == [("r0", "r0"), ("r1", "r1"), ("r2", "r2")]
        store.log_request([row("r3", exp="old")])
        assert store.arm_counts("old") == {"a": 3, "b": 1} and isinstance(store.claim("old", "c", "k", "b"), Claim)


def test_lost_postgres_connection_is_db_unavailable_then_reconnects(postgres_url):
    with closing(Store.open(postgres_url)) as store:
        store.add_experiment("e1", "", ARMS, 1.0)
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        with pytest.raises(StoreError) as lost:
            store.log_request([row("r1")])
        assert lost.value.code == "db_unavailable"
        store.log_request([row("r1")])   # the next call reconnects
        assert store.arm_counts("e1") == {"a": 1}


def hold_lock(path):
    """Another process holding the SQLite database's write lock (BEGIN EXCLUSIVE) until a line reaches its stdin
    (not for a fixed time, which a loaded machine can outrun); returns once held."""
    job = (f"import sqlite3, sys; c = sqlite3.connect({str(path)!r}, isolation_level=None); "
           f"c.execute('BEGIN EXCLUSIVE'); print('held', flush=True); sys.stdin.readline(); c.execute('COMMIT')")
    proc = subprocess.Popen([sys.executable, "-c", job], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def post_chat(base_url, k, **kw):
    body = {"model": "ab", "messages": [{"role": "user", "content": f"the keeper {k}"}], "max_tokens": 2,
            "user": f"user{k}", "experiment": "exp"} | kw
    return httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)


def logged_ids(store):
    return [r["id"] for r in store.requests("exp")]


def test_a_locked_then_full_database_gives_coded_503s_never_a_200_without_its_row(model_dirs, tmp_path):
    """One server on an A/B log capped at 60 pages of 4 KiB. Another process holds the write lock: /health says
    db_locked and requests wait out the busy timeout, then get 503 db_locked; once it lets go the server writes again.
    Then rows of ~2 KiB fill the log: 503 db_full (Retry-After 1), /health says db_full. Every acknowledged request
    has its row, and the experiment's counts are the rows."""
    path = tmp_path / "ab.sqlite"
    db = f"file:{path}?max_page_count=60"
    config = {"models": {"tiny": {"path": str(model_dirs["llama"])}}, "db": db, "allow_no_auth": True}
    acked = []
    with running_server(config, workdir=tmp_path) as server:
        assert httpx.post(server.base_url + "/v1/experiments", json={"id": "exp", "arms": ARMS}).status_code == 201
        assert httpx.get(server.base_url + "/health").json()["status"] == "ok"
        acked += [r.json()["id"] for r in (post_chat(server.base_url, k) for k in range(3)) if r.status_code == 200]
        holder = hold_lock(path)
        time.sleep(HEALTH_TTL_S + 0.1)   # past the verdict cached before the lock
        health = httpx.get(server.base_url + "/health", timeout=30)
        assert health.status_code == 503 and health.json()["database"] == "db_locked"

        async def during():
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
                bodies = [{"model": "ab", "messages": [{"role": "user", "content": f"the keeper {k}"}],
                           "max_tokens": 2, "user": f"user{k}", "experiment": "exp"} for k in range(3, 5)]
                return await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
        answers = asyncio.run(during())   # each waits out the busy timeout, the lock held throughout
        assert [(r.status_code, r.json()["error"]["code"]) for r in answers] == [(503, "db_locked")] * 2
        holder.communicate("release\n", timeout=30)
        assert holder.returncode == 0   # the lock is released
        time.sleep(HEALTH_TTL_S + 0.1)
        assert httpx.get(server.base_url + "/health").status_code == 200
        for k in range(5, 8):
            r = post_chat(server.base_url, k)
            assert r.status_code == 200
            acked.append(r.json()["id"])
        assert len(acked) >= 6

        codes = []
        for k in range(8, 88):   # ~2 KiB of metadata a row: the cap is reached within these
            r = post_chat(server.base_url, k, metadata={"pad": "x" * 2000})
            codes.append(r.status_code)
            if r.status_code == 200:
                acked.append(r.json()["id"])
            else:
                assert r.status_code == 503 and r.json()["error"]["code"] == "db_full"
                assert r.headers["retry-after"] == "1"
        assert 503 in codes and 200 in codes
        time.sleep(HEALTH_TTL_S + 0.1)   # past the cached verdict
        health = httpx.get(server.base_url + "/health")
        assert health.status_code == 503 and health.json()["database"] == "db_full"
        counts = httpx.get(server.base_url + "/v1/experiments/exp").json()["requests"]
    with closing(Store.open(str(path))) as store:
        assert sorted(logged_ids(store)) == sorted(acked)
        assert store.arm_counts("exp") == counts and sum(counts.values()) == len(acked)


def test_ab_report_reads_a_postgresql_log(postgres_url):
    from typer.testing import CliRunner

    from rolemrc.cli import app

    with closing(Store.open(postgres_url)) as store:
        store.add_experiment("e1", "over PostgreSQL", ARMS, 1.0)
        store.log_request([row(f"r{k}", arm="ab"[k % 2], user=f"u{k % 4}") for k in range(8)])
    result = CliRunner().invoke(app, ["ab", "report", "e1", "--db", postgres_url, "--rounds", "50"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["requests"] == 8 and set(report["arms"]) == {"a", "b"}


def test_an_unreachable_postgres_is_an_error_line_at_start(model_dirs, tmp_path):
    config = {"models": {"tiny": {"path": str(model_dirs["llama"])}}, "db": f"postgresql://postgres@127.0.0.1:{free_port()}/x"}
    server = launch_server(config, workdir=tmp_path)
    assert server.wait(120) != 0
    assert "error: the database postgresql://postgres@127.0.0.1" in server.logs() and "is unavailable" in server.logs()
