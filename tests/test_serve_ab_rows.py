"""A/B rows that cannot be skewed, over real HTTP and a real SQLite log: every request assigned to an arm is one row,
refusals included (`refused`, with the error's code), so `ab report` can count each arm's refusals and flag arms
whose refusal rates differ; rows say which caller (a hash of its API key) sent them; an experiment may hide its arm
from whole, streamed and replayed responses and from its errors; a log of the previous schema migrates (SQLite and
PostgreSQL)."""

import hashlib
import json
import re
import sqlite3
import time
from contextlib import closing
from types import SimpleNamespace

import httpx
import pytest
from typer.testing import CliRunner

from rolemrc.ab.report import build_report
from rolemrc.cli import app
from rolemrc.core.stats import rates_test
from rolemrc.intervene import Restraint
from rolemrc.serve.experiments import assign
from rolemrc.serve.launch import running_server
from rolemrc.serve.state import caller_id
from rolemrc.serve.store import Store
from rolemrc.serve.store.postgres import PostgresBackend
from rolemrc.serve.store.schema import MIGRATIONS, VERSION
from rolemrc.serve.store.sqlite import SqliteBackend

ADMIN, SERVE = "admin-key-ab-rows", "serve-key-ab-rows"
SHORT = "the keeper"
LONG = " ".join(["the keeper of the lighthouse watched storms roll over grey water"] * 12)   # ~120 words
SKEW_ARMS = [{"name": "small", "model": "small", "weight": 1.0}, {"name": "big", "model": "big", "weight": 1.0}]


def key_id(key: str) -> str:
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:12]


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    """Models `big` and `small` (the same tiny Llama, `small` with a 64-token context), restraint `mute`, two API
    keys; the log already holds experiment `elsewhere`, made by a server that served a model this one does not."""
    root = tmp_path_factory.mktemp("ab-rows")
    Restraint(name="mute", hook="mlp.act", factor=0.0, units={0: [4, 5]}).save(root / "mute.yaml")
    (root / "keys.txt").write_text(f"{ADMIN} admin\n{SERVE}\n")
    with closing(Store.open(str(root / "ab.sqlite"))) as store:
        store.add_experiment("elsewhere", "", [{"name": "here", "model": "big", "weight": 1.0},
                                                {"name": "gone", "model": "vanished", "weight": 1.0}], 1.0)
    llama = str(model_dirs["llama"])
    config = {"models": {"big": {"path": llama}, "small": {"path": llama, "max_model_len": 64}},
              "restraints": {"mute": "mute.yaml"}, "api_key_file": "keys.txt", "db": "ab.sqlite",
              "max_new_tokens": 16, "max_queue_per_key": 4}
    with running_server(config, workdir=root) as srv:
        yield srv, root


def post(server, path, key=SERVE, **kw):
    return httpx.post(server.base_url + path, headers={"Authorization": f"Bearer {key}", **kw.pop("headers", {})},
                      timeout=60, **kw)


def ask(exp, case, prompt=SHORT, **extra):
    return {"model": "what-the-client-says", "messages": [{"role": "user", "content": prompt}], "experiment": exp,
            "metadata": {"case": case}, "max_tokens": 2, **extra}


def rows(root, where="1 = 1", params=()):
    with closing(sqlite3.connect(root / "ab.sqlite")) as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute(f"SELECT * FROM requests WHERE {where} ORDER BY started, id", params)]


def case_rows(root, case):
    return rows(root, "json_extract(metadata, '$.case') = ?", (case,))


def test_every_assigned_request_is_one_row_and_the_report_flags_unequal_refusals(server, tmp_path):
    """40 users, two of three with a prompt over `small`'s context: the `small` arm refuses those (400
    context_length_exceeded), `big` serves all. Each request is exactly one row, refusals included with their code;
    `ab report` counts refusals per arm and flags the difference (Fisher's exact p < 0.05), its scoring unchanged."""
    srv, root = server
    made = post(srv, "/v1/experiments", ADMIN, json={"id": "skew", "arms": SKEW_ARMS})
    assert made.status_code == 201 and made.json()["reveal_arm"] is True
    expected = {}
    for k in range(40):
        user, long = f"u{k}", k % 3 != 0
        arm = assign("skew", SKEW_ARMS, user)["name"]
        answer = post(srv, "/v1/chat/completions", json=ask("skew", f"skew-{k}", LONG if long else SHORT, user=user))
        refused = long and arm == "small"
        assert answer.status_code == (400 if refused else 200), (k, arm, answer.text)
        if refused:
            assert answer.json()["error"]["code"] == "context_length_exceeded"
        else:
            assert answer.json()["arm"] == arm
        expected[k] = (arm, answer.json()["error"]["message"] if refused else None)
    for k, (arm, message) in expected.items():
        [row] = case_rows(root, f"skew-{k}")   # exactly one row per request, refused or not
        assert row["arm"] == arm and row["caller"] == key_id(SERVE), row
        if message:
            assert (row["finish_reason"], row["error_code"], row["response"]) == ("refused", "context_length_exceeded", "")
            assert row["error"] == message and row["completion_tokens"] == 0
        else:
            assert row["finish_reason"] in ("stop", "length") and row["error"] is None and row["error_code"] is None
    per_arm = httpx.get(srv.base_url + "/v1/experiments/skew", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    arms = {name: [a for a, _ in expected.values()].count(name) for name in ("small", "big")}
    assert per_arm["requests"] == arms and min(arms.values()) >= 10   # refusals counted in their arm

    refused = sum(message is not None for _, message in expected.values())
    result = CliRunner().invoke(app, ["ab", "report", "skew", "--db", str(root / "ab.sqlite"), "--rounds", "100"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    got = report["refusals"]
    assert got["arms"]["small"] == {"requests": arms["small"], "refused": refused, "rate": refused / arms["small"],
                                    "by_code": {"context_length_exceeded": refused}}
    assert got["arms"]["big"]["refused"] == 0 and got["test"] == "fisher-exact" and got["unit"] == "request"
    assert got["p"] < 0.05 and got["flagged"] and got["text"].startswith("FLAG: the arms' refusal rates differ")
    assert got["text"] in report["notes"] and got["text"] in result.stderr
    small = report["arms"]["small"]   # scoring as before: only stop/length rows, the rest counted as failed
    assert small["n"] == arms["small"] - refused and small["failed_by_reason"] == {"refused": refused}
    assert report["arms"]["big"]["n"] == arms["big"] and report["arms"]["big"]["failed"] == 0


def test_other_refusals_are_rows_with_their_code_and_free_their_key(server):
    """A refusal before the engine (max_tokens over the server's cap, whole or streamed; an arm whose model this
    server does not serve) is one row with its code; its Idempotency-Key is freed, so a retry runs (and logs)."""
    srv, root = server
    post(srv, "/v1/experiments", ADMIN, json={"id": "caps", "arms": [{"name": "a", "model": "big"}]})
    for stream in (False, True):
        case = f"cap-{stream}"
        body = ask("caps", case, max_tokens=17, stream=stream, user="u1")
        first = post(srv, "/v1/chat/completions", json=body, headers={"Idempotency-Key": case})
        again = post(srv, "/v1/chat/completions", json=body, headers={"Idempotency-Key": case})
        for answer in (first, again):   # not replayed, not 409: the key was freed with the row
            assert answer.status_code == 400 and answer.json()["error"]["code"] == "max_tokens_too_large"
        logged = case_rows(root, case)
        assert [(r["finish_reason"], r["error_code"], r["idempotency_key"]) for r in logged] == [
            ("refused", "max_tokens_too_large", case)] * 2
    # `elsewhere`'s arm `gone` names a model this server does not serve: refused at routing, after assignment
    users = {assign("elsewhere", [{"name": "here", "weight": 1}, {"name": "gone", "weight": 1}], f"u{k}")["name"]: f"u{k}"
             for k in range(20)}
    gone = post(srv, "/v1/chat/completions", json=ask("elsewhere", "gone", user=users["gone"]))
    here = post(srv, "/v1/chat/completions", json=ask("elsewhere", "here", user=users["here"]))
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found" and here.status_code == 200
    [row] = case_rows(root, "gone")
    assert (row["arm"], row["model"], row["finish_reason"], row["error_code"]) == ("gone", "vanished", "refused",
                                                                                   "model_not_found")
    assert len(case_rows(root, "here")) == 1
    # refused before an arm is assigned: no row (an unknown experiment, a body the schema refuses)
    assert post(srv, "/v1/chat/completions", json=ask("nope", "no-exp")).status_code == 404
    assert post(srv, "/v1/chat/completions", json=ask("caps", "bad-body", n=0)).status_code == 422
    assert case_rows(root, "no-exp") == case_rows(root, "bad-body") == []


def test_rows_carry_a_hash_of_their_caller(server):
    srv, root = server
    post(srv, "/v1/experiments", ADMIN, json={"id": "callers", "arms": [{"name": "a", "model": "big"}]})
    for key in (ADMIN, SERVE):
        assert post(srv, "/v1/chat/completions", key, json=ask("callers", f"caller-{key[:5]}")).status_code == 200
    logged = {key: case_rows(root, f"caller-{key[:5]}")[0]["caller"] for key in (ADMIN, SERVE)}
    assert logged == {ADMIN: key_id(ADMIN), SERVE: key_id(SERVE)} and logged[ADMIN] != logged[SERVE]
    assert not any(key in json.dumps(rows(root)) for key in (ADMIN, SERVE))   # never the key itself
    # without keys, a hash of the client's address
    anonymous = SimpleNamespace(state=SimpleNamespace(key=None), client=SimpleNamespace(host="10.1.2.3"))
    assert caller_id(anonymous) == "addr:" + hashlib.sha256(b"10.1.2.3").hexdigest()[:12]


def test_a_keyless_callers_rows_and_idempotency_keys_name_it_alike(model_dirs, tmp_path):
    """Without keys, a caller's rows and the idempotency keys it holds say the same `caller`: a hash of its
    address."""
    from fastapi.testclient import TestClient

    from rolemrc.serve.app import create_app
    from rolemrc.serve.config import ServeConfig

    config = ServeConfig.from_dict({"models": {"big": str(model_dirs["llama"])}, "db": str(tmp_path / "ab.sqlite"),
                                    "allow_no_auth": True})
    with TestClient(create_app(config), base_url="http://localhost") as client:   # its client is at "testclient"
        arms = [{"name": "a", "model": "big"}]
        assert client.post("/v1/experiments", json={"id": "anon", "arms": arms}).status_code == 201
        sent = [client.post("/v1/chat/completions", json=ask("anon", "anon", user="u1"),
                            headers={"Idempotency-Key": "once"}) for _ in range(2)]
        assert [r.status_code for r in sent] == [200, 200] and sent[1].headers["Idempotent-Replayed"] == "true"
    with closing(sqlite3.connect(tmp_path / "ab.sqlite")) as db:
        callers = [db.execute(f"SELECT caller FROM {table}").fetchall() for table in ("requests", "idempotency")]
    assert callers == [[("addr:" + hashlib.sha256(b"testclient").hexdigest()[:12],)]] * 2


def sse(text):
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("reveal", [True, False])
def test_reveal_arm_decides_what_whole_streamed_and_replayed_responses_say(server, reveal):
    srv, root = server
    exp = f"reveal-{reveal}"
    body = {"id": exp, "arms": [{"name": "m", "model": "big", "restraint": "mute"}]}
    if not reveal:
        body["reveal_arm"] = False
    made = post(srv, "/v1/experiments", ADMIN, json=body)
    assert made.status_code == 201 and made.json()["reveal_arm"] is reveal
    shown = httpx.get(f"{srv.base_url}/v1/experiments/{exp}", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert shown["reveal_arm"] is reveal

    said = {"experiment": exp, "arm": "m", "restraint": "mute", "model": "big+mute"} if reveal else {
        "experiment": None, "arm": None, "restraint": None, "model": "what-the-client-says"}
    whole = {"headers": {"Idempotency-Key": f"{exp}-whole"}, "json": ask(exp, f"{exp}-whole", user="u1")}
    streamed = {"headers": {"Idempotency-Key": f"{exp}-stream"},
                "json": ask(exp, f"{exp}-stream", user="u1", stream=True, stream_options={"include_usage": True})}
    for attempt in ("first", "replay"):
        answer = post(srv, "/v1/chat/completions", **whole)
        assert answer.status_code == 200 and ("Idempotent-Replayed" in answer.headers) == (attempt == "replay")
        assert {k: answer.json()[k] for k in said} == said, (attempt, answer.json())
        for stream_replay in (streamed, {**streamed, "json": {**streamed["json"], "stream": False}}):
            answer = post(srv, "/v1/chat/completions", **stream_replay)
            assert answer.status_code == 200
            chunks = sse(answer.text) if stream_replay["json"]["stream"] else [answer.json()]
            assert chunks and all(c["model"] == said["model"] for c in chunks), (attempt, answer.text)
            assert all(c.get(k) == said[k] for c in chunks for k in ("experiment", "arm", "restraint"))
            if not reveal:
                assert "big+mute" not in answer.text and '"m"' not in answer.text
    for case in (f"{exp}-whole", f"{exp}-stream"):   # the log keeps what served it, whatever the client saw
        [row] = case_rows(root, case)
        assert (row["arm"], row["model"], row["restraint"]) == ("m", "big+mute", "mute")


def test_an_experiment_that_hides_its_arms_names_none_of_them_in_its_errors(server):
    """Refusals after assignment (a prompt over `small`'s context, n over the caller's share of the queue, an arm's
    restraint or model this server lacks), whole and streamed: no arm, model or restraint name of the arm in the
    body or a header, while the log keeps what the arm's engine said."""
    srv, root = server
    arms = [{"name": "hush", "model": "small", "restraint": "mute", "weight": 1.0},
            {"name": "ghost-arm", "model": "big", "restraint": "ghost", "weight": 1.0},
            {"name": "lost-arm", "model": "vanished", "weight": 1.0}]
    with closing(Store.open(str(root / "ab.sqlite"))) as store:   # arms the API would refuse to create
        store.add_experiment("blind", "", arms, 1.0, reveal_arm=False)
    users = {assign("blind", arms, f"u{k}")["name"]: f"u{k}" for k in range(40)}
    names = {"hush": {"hush", "small", "mute"}, "ghost-arm": {"ghost-arm", "big", "ghost"},
             "lost-arm": {"lost-arm", "vanished"}}
    cases = [("hush", {"messages": [{"role": "user", "content": LONG}]}, 400, "context_length_exceeded"),
             ("hush", {"n": 5}, 429, "key_queue_full"), ("ghost-arm", {}, 404, "restraint_not_found"),
             ("lost-arm", {}, 404, "model_not_found")]
    for k, (arm, extra, status, code) in enumerate(cases):
        for stream in (False, True):
            case = f"blind-{k}-{stream}"
            answer = post(srv, "/v1/chat/completions", json={**ask("blind", case, user=users[arm], stream=stream),
                                                             **extra})
            assert (answer.status_code, answer.json()["error"]["code"]) == (status, code), answer.text
            said = answer.text + json.dumps(dict(answer.headers))
            assert not [n for n in names[arm] if re.search(rf"\b{re.escape(n)}\b", said)], (case, said)
            row = case_rows(root, case)[0]
            assert row["arm"] == arm and row["error_code"] == code
    assert "'vanished'" in case_rows(root, "blind-3-False")[0]["error"]   # the log says what the client was not told


def test_the_report_tests_refusal_rates_of_any_number_of_arms(tmp_path):
    """Three arms (chi-square): one refusing most requests is flagged; equal rates (Fisher's exact, p = 1) are not;
    old rows without `error_code` count as refused for an unknown reason."""
    arms = [{"name": n, "model": "m", "weight": 1.0} for n in ("a", "b", "c")]
    with closing(Store.open(str(tmp_path / "ab.sqlite"))) as store:
        for exp, refused in (("three", {"a": 8, "b": 1, "c": 1}), ("even", {"a": 2, "b": 2})):
            store.add_experiment(exp, "", arms[:len(refused)], 1.0)
            for arm, n in refused.items():
                for k in range(10):
                    no = k >= n
                    store.log_request([{"id": f"{exp}-{arm}-{k}", "request_id": f"{exp}-{arm}-{k}", "experiment": exp,
                                        "arm": arm, "user": f"{arm}{k}", "model": "m", "endpoint": "chat",
                                        "messages": [], "response": "ok" if no else "", "latency_s": 0.1,
                                        "finish_reason": "stop" if no else "refused", "prompt_tokens": 1,
                                        "completion_tokens": 1 if no else 0, "started": float(k), "finished": float(k),
                                        "error_code": None if no or arm != "a" else "queue_full"}])
        three = build_report(store, "three", metrics=(), rounds=50)["refusals"]
        even = build_report(store, "even", metrics=(), rounds=50)["refusals"]
    assert three["test"] == "chi-square" and three["p"] < 0.01 and three["flagged"] and three["dof"] == 2
    assert three["arms"]["a"]["by_code"] == {"queue_full": 8} and three["arms"]["b"]["by_code"] == {"unknown": 1}
    assert even["test"] == "fisher-exact" and even["p"] == 1.0 and not even["flagged"]
    assert even["text"].startswith("refusals: a 2/10, b 2/10")
    assert rates_test([0, 0], [5, 5])["p"] == 1.0 and rates_test([3], [5])["test"] == "none"


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path):
    return str(tmp_path / "ab.sqlite") if request.param == "sqlite" else request.getfixturevalue("postgres_url")


def test_a_log_of_the_previous_schema_migrates_keeping_its_rows(db):
    """A database at the schema version before the migration that added `error_code`, `caller` and `reveal_arm`
    migrates when opened: old rows kept with NULL caller and code, old experiments reveal their arm."""
    previous = next(k for k, m in enumerate(MIGRATIONS) if any("ADD COLUMN caller" in s for s in m))
    backend = SqliteBackend(db) if db.endswith(".sqlite") else PostgresBackend(db)
    with closing(backend), backend.transaction(exclusive=True) as tx:
        tx.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        for migration in MIGRATIONS[:previous]:
            for statement in migration:
                tx.execute(statement)
        tx.execute("INSERT INTO schema_version (version) VALUES (?)", (previous,))
        tx.execute("INSERT INTO experiments (id, description, arms, created) VALUES ('old', '', '[]', 1.0)")
        tx.execute("INSERT INTO requests (id, request_id, experiment, arm, model, endpoint, messages, response,"
                   " finish_reason, latency_s, prompt_tokens, completion_tokens, started, finished)"
                   " VALUES ('r0', 'r0', 'old', 'a', 'tiny', 'chat', '[]', 'x', 'stop', 0.1, 1, 1, 1.0, 1.0)")
        columns = tx.execute("SELECT * FROM requests")[0]
    assert "caller" not in columns and "error_code" not in columns
    with closing(Store.open(db)) as store:
        [old] = store.requests("old")
        assert (old["id"], old["caller"], old["error_code"], old["response"]) == ("r0", None, None, "x")
        assert store.experiment("old")["reveal_arm"] is True
        store.log_request([{**old, "id": "r1", "request_id": "r1", "caller": "key:abc", "error_code": "queue_full",
                            "finish_reason": "refused", "started": time.time()}])
        assert [(r["id"], r["caller"], r["error_code"]) for r in store.requests("old")] == [
            ("r0", None, None), ("r1", "key:abc", "queue_full")]
        assert store.add_experiment("new", "", [], 2.0, reveal_arm=False) and not store.experiment("new")["reveal_arm"]
        with store.backend.transaction() as tx:
            assert tx.execute("SELECT version FROM schema_version") == [{"version": VERSION}]
