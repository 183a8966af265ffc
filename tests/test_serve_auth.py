"""Auth that fails closed, over real HTTP: a configured key source that yields no key stops the start (one `error:`
line, exit 2, before any model loads); a `serve` key serves completions and reads, an `admin` key also registers and
deletes restraints and owns experiments (403 `forbidden` otherwise); deleting a restraint or an experiment frees its
name; /health details and /metrics are behind a key unless the config opens them. Without keys, admin routes are
403 `admin_needs_keys` unless the config says `allow_no_auth: true`; a Host header naming neither a loopback name nor
one of `allowed_hosts` is 400 `host_not_allowed`."""

import json
import sqlite3

import httpx
import openai
import pytest

from rolemrc.core.errors import EXIT_INPUT
from rolemrc.intervene import Restraint
from rolemrc.serve.launch import running_server

ADMIN, SERVE = "admin-key-0123", "serve-key-4567"
CHAT = [{"role": "user", "content": "the storms quarter the old"}]
SPEC = {"hook": "mlp.act", "factor": 0.0, "units": {"0": [1, 2, 3]}}


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-auth")
    Restraint(name="mute", hook="mlp.act", factor=0.0, units={0: [4, 5]}).save(root / "mute.yaml")
    (root / "keys.txt").write_text(f"# operators\n{ADMIN} admin\n\n{SERVE}\n")
    config = {"models": {"tiny": {"path": str(model_dirs["llama"])}}, "restraints": {"mute": "mute.yaml"},
              "allow_inline_restraints": True, "api_key_file": "keys.txt", "db": "ab.sqlite", "default_max_tokens": 4}
    with running_server(config, workdir=root) as srv:
        yield srv


def call(server, method: str, path: str, key: str | None, **kw) -> httpx.Response:
    return httpx.request(method, server.base_url + path, headers=auth(key), timeout=60, **kw)


def test_an_empty_key_source_stops_the_cli_before_any_model_loads(tmp_path):
    """The model path does not exist: the key error comes first, so nothing was loaded or even checked."""
    from typer.testing import CliRunner

    from rolemrc.cli import app

    (tmp_path / "keys.txt").write_text("\n   \n# no key yet\n")
    (tmp_path / "serve.yaml").write_text("models: {m: nowhere}\napi_key_file: keys.txt\n")
    done = CliRunner(env={"NO_COLOR": "1"}).invoke(app, ["serve", "--config", str(tmp_path / "serve.yaml")])
    lines = [line for line in done.output.splitlines() if line.strip()]
    assert done.exit_code == EXIT_INPUT and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and "holds no API key" in lines[0] and "keys.txt" in lines[0]


def test_keys_are_required_and_roles_decide_what_a_key_may_do(server):
    assert call(server, "GET", "/v1/models", None).json()["error"]["code"] == "missing_api_key"
    wrong = call(server, "GET", "/v1/models", "wrong")
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    sdk = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        sdk.chat.completions.create(model="tiny", messages=CHAT)
    chat = {"model": "tiny", "messages": CHAT, "max_tokens": 3}
    for key in (SERVE, ADMIN):   # both roles serve and read
        assert call(server, "POST", "/v1/chat/completions", key, json=chat).status_code == 200
        assert call(server, "GET", "/v1/models", key).status_code == 200
        assert call(server, "GET", "/v1/restraints", key).status_code == 200
    arms = [{"name": "a", "model": "tiny"}, {"name": "b", "model": "tiny+mute"}]
    admin_only = [("POST", "/v1/restraints", {"name": "late", "spec": SPEC}),
                  ("POST", "/v1/experiments", {"id": "roles", "arms": arms}),
                  ("GET", "/v1/experiments/roles", None), ("DELETE", "/v1/restraints/late", None),
                  ("DELETE", "/v1/experiments/roles", None)]
    for method, path, body in admin_only:
        refused = call(server, method, path, SERVE, json=body)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden", (method, path)
    for (method, path, body), status in zip(admin_only, (201, 201, 200, 204, 204)):
        assert call(server, method, path, ADMIN, json=body).status_code == status, (method, path)
    # a serve key sends requests into an experiment (its rows are logged), it just cannot create or read one
    assert call(server, "POST", "/v1/experiments", ADMIN, json={"id": "roles2", "arms": arms}).status_code == 201
    sent = call(server, "POST", "/v1/chat/completions", SERVE, json={**chat, "model": "roles2", "experiment": "roles2"})
    assert sent.status_code == 200 and sent.json()["arm"] in ("a", "b")
    assert call(server, "GET", "/v1/experiments/roles2", ADMIN).json()["requests"] == {sent.json()["arm"]: 1}


def test_an_idempotency_key_belongs_to_its_caller(server):
    """Two API keys send the same `Idempotency-Key` into one experiment (the real openai client): each gets its own
    completion of its own prompt, both are logged; each key's retry replays its own answer, and the same key reused
    for another body is 422 `idempotency_key_reused`."""
    assert call(server, "POST", "/v1/experiments", ADMIN,
                json={"id": "idem", "arms": [{"name": "a", "model": "tiny"}]}).status_code == 201

    def send(key, prompt):
        sdk = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)
        return sdk.chat.completions.with_raw_response.create(
            model="idem", messages=[{"role": "user", "content": prompt}], max_tokens=3, user="u1",
            extra_body={"experiment": "idem"}, extra_headers={"Idempotency-Key": "same"})
    first, second = send(ADMIN, "the admin asks"), send(SERVE, "the serve key asks")
    assert "Idempotent-Replayed" not in first.headers and "Idempotent-Replayed" not in second.headers
    ids = first.parse().id, second.parse().id
    with sqlite3.connect(server.config.parent / "ab.sqlite") as db:
        logged = db.execute("SELECT request_id, messages, idempotency_key FROM requests WHERE experiment = 'idem'"
                            " ORDER BY started").fetchall()
    assert [(rid, json.loads(m)[0]["content"], k) for rid, m, k in logged] == [
        (ids[0], "the admin asks", "same"), (ids[1], "the serve key asks", "same")] and ids[0] != ids[1]
    again = send(SERVE, "the serve key asks")
    assert again.headers["Idempotent-Replayed"] == "true" and again.parse().id == ids[1]
    with pytest.raises(openai.UnprocessableEntityError) as reused:
        send(SERVE, "the serve key asks something else")
    assert reused.value.code == "idempotency_key_reused" and reused.value.param == "Idempotency-Key"


def test_deleting_frees_the_name_and_takes_the_rows(server):
    registered = call(server, "POST", "/v1/restraints", ADMIN, json={"name": "gone", "spec": SPEC})
    assert registered.status_code == 201
    arms = [{"name": "base", "model": "tiny"}, {"name": "g", "model": "tiny", "restraint": "gone"}]
    assert call(server, "POST", "/v1/experiments", ADMIN, json={"id": "del", "arms": arms}).status_code == 201
    for k in range(4):
        body = {"model": "del", "experiment": "del", "user": f"u{k}", "messages": CHAT, "max_tokens": 2}
        assert call(server, "POST", "/v1/chat/completions", SERVE, json=body).status_code == 200
    in_use = call(server, "DELETE", "/v1/restraints/gone", ADMIN)
    assert in_use.status_code == 409 and in_use.json()["error"]["code"] == "restraint_in_use"
    from_config = call(server, "DELETE", "/v1/restraints/mute", ADMIN)
    assert from_config.status_code == 409 and from_config.json()["error"]["code"] == "restraint_in_config"
    assert call(server, "DELETE", "/v1/restraints/nope", ADMIN).status_code == 404
    assert call(server, "DELETE", "/v1/experiments/nope", ADMIN).status_code == 404

    assert call(server, "DELETE", "/v1/experiments/del", ADMIN).status_code == 204
    assert call(server, "GET", "/v1/experiments/del", ADMIN).status_code == 404
    with sqlite3.connect(server.config.parent / "ab.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM requests WHERE experiment = 'del'").fetchone() == (0,)
    again = call(server, "POST", "/v1/experiments", ADMIN, json={"id": "del", "arms": arms[:1]})
    assert again.status_code == 201   # the id is free, and starts with no rows
    assert call(server, "GET", "/v1/experiments/del", ADMIN).json()["requests"] == {}

    assert call(server, "DELETE", "/v1/restraints/gone", ADMIN).status_code == 204
    models = [m["id"] for m in call(server, "GET", "/v1/models", SERVE).json()["data"]]
    assert "tiny+gone" not in models and "tiny+mute" in models
    assert call(server, "POST", "/v1/chat/completions", SERVE,
                json={"model": "tiny+gone", "messages": CHAT}).status_code == 404
    other = {**SPEC, "factor": 0.5}   # the name is free for another restraint
    assert call(server, "POST", "/v1/restraints", ADMIN, json={"name": "gone", "spec": other}).status_code == 201


def test_health_details_and_metrics_need_a_key(server):
    assert call(server, "GET", "/health", None).json() == {"status": "ok"}
    assert call(server, "GET", "/health", SERVE).json() == {"status": "ok"}
    assert call(server, "GET", "/health", "wrong").json() == {"status": "ok"}
    assert "tiny+mute" in call(server, "GET", "/health", ADMIN).json()["models"]
    assert call(server, "GET", "/metrics", None).status_code == 401
    assert call(server, "GET", "/metrics", "wrong").status_code == 401
    assert "rolemrc_requests_total" in call(server, "GET", "/metrics", SERVE).text


def test_keys_from_the_environment_and_public_health_and_metrics(model_dirs, tmp_path):
    config = {"models": {"tiny": {"path": str(model_dirs["llama"])}}, "api_key_env": "SERVE_KEYS", "db": None,
              "public_health_details": True, "public_metrics": True}
    with running_server(config, workdir=tmp_path, env={"SERVE_KEYS": f" {ADMIN}:admin , {SERVE} ,"}) as srv:
        assert call(srv, "GET", "/health", None).json()["models"] == ["tiny"]
        assert call(srv, "GET", "/metrics", None).status_code == 200
        assert call(srv, "GET", "/v1/models", None).status_code == 401
        assert call(srv, "POST", "/v1/restraints", SERVE, json={"name": "x", "spec": SPEC}).status_code == 403
        # allow_inline_restraints is off: past the role check, the registration itself is refused
        assert call(srv, "POST", "/v1/restraints", ADMIN, json={"name": "x", "spec": SPEC}).status_code == 400


@pytest.fixture(scope="module")
def keyless(model_dirs, tmp_path_factory):
    """A loopback server without keys or allow_no_auth that also serves the Host name api.example."""
    config = {"models": {"tiny": {"path": str(model_dirs["llama"])}}, "allow_inline_restraints": True,
              "db": "ab.sqlite", "default_max_tokens": 4, "allowed_hosts": ["api.example"]}
    with running_server(config, workdir=tmp_path_factory.mktemp("serve-keyless")) as srv:
        yield srv


def test_without_keys_admin_routes_need_allow_no_auth(keyless):
    chat = {"model": "tiny", "messages": CHAT, "max_tokens": 3}
    assert call(keyless, "POST", "/v1/chat/completions", None, json=chat).status_code == 200
    assert call(keyless, "GET", "/v1/models", None).status_code == 200
    assert call(keyless, "GET", "/v1/restraints", None).status_code == 200
    for method, path, body in (("POST", "/v1/restraints", {"name": "late", "spec": SPEC}),
                               ("POST", "/v1/experiments", {"id": "x", "arms": [{"name": "a", "model": "tiny"}]}),
                               ("GET", "/v1/experiments/x", None), ("DELETE", "/v1/experiments/x", None),
                               ("DELETE", "/v1/restraints/late", None)):
        refused = call(keyless, method, path, None, json=body)
        error = refused.json()["error"]
        assert refused.status_code == 403 and error["code"] == "admin_needs_keys", (method, path, refused.text)
        assert "allow_no_auth" in error["message"] and "api_key_file" in error["message"]
    assert call(keyless, "GET", "/health", None).json() == {"status": "ok"}   # no admin view either
    # with allow_no_auth: true every caller is admin: the keyless servers of test_serve_completions, test_sweep_ab,
    # test_serve_store, test_serve_ops and test_serve_replicas create experiments and register restraints


def test_a_host_header_outside_the_allow_list_is_400_before_routing(keyless):
    def sent(host: str, path: str = "/v1/models") -> httpx.Response:
        return httpx.get(keyless.base_url + path, headers={"Host": host}, timeout=60)

    for host in ("evil.example", "evil.example:80", "api.example.evil.example", ""):
        for path in ("/v1/models", "/health", "/nowhere"):
            refused = sent(host, path)
            assert refused.status_code == 400, (host, path, refused.text)
            assert refused.json()["error"]["code"] == "host_not_allowed" and "allowed_hosts" in refused.text
    for host in (f"127.0.0.1:{keyless.port}", "localhost", f"[::1]:{keyless.port}", "api.example", "API.example:443"):
        assert sent(host).status_code == 200, host


@pytest.mark.parametrize("hosts, says", [("api.example", "must be a non-empty list"), ([], "must be a non-empty list"),
                                         (["api.example:8000"], "'api.example:8000' is not a host name"),
                                         (["https://api.example"], "is not a host name")])
def test_a_bad_allowed_hosts_entry_is_a_config_error(hosts, says):
    from rolemrc.serve.config import ServeConfig
    from rolemrc.serve.errors import ServeConfigError

    with pytest.raises(ServeConfigError) as err:
        ServeConfig.from_dict({"models": {"m": "nowhere"}, "allowed_hosts": hosts})
    assert str(err.value).startswith("allowed_hosts") and says in str(err.value)
