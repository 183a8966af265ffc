"""Bounded work per request, over real HTTP against a real server: each limit (docs/serve.md "Limits") refused with
a 4xx naming the field before any work is done, quickly, and one caller's flood leaving room for the others."""

import json
import time

import httpx
import pytest

from rolemrc.serve.launch import running_server

LIMITS = {"max_body_bytes": 2 << 20, "max_inline_units": 64, "max_stop_strings": 2, "max_stop_chars": 8,
          "max_choices": 8, "max_metadata_bytes": 100, "max_queue_per_key": 4, "max_queue": 6,
          "max_new_tokens": 450, "default_max_tokens": 5}
CHAT = [{"role": "user", "content": "the storms quarter the old"}]


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-limits")
    config = {"models": {"tiny": {"path": str(model_dirs["llama"])},
                         "short": {"path": str(model_dirs["llama"]), "max_model_len": 24}},
              "allow_inline_restraints": True, "db": None, **LIMITS}
    with running_server(config, workdir=root) as srv:
        yield srv


def post(server, path="/v1/chat/completions", **body):
    return httpx.post(server.base_url + path, json={"model": "tiny", "messages": CHAT, **body}, timeout=60)


def refused(response, status, code, param):
    error = response.json().get("error", {})
    assert (response.status_code, error.get("code"), error.get("param")) == (status, code, param), response.text
    return error


def test_max_model_len_caps_prompt_and_completion(server):
    """The `short` model serves at most 24 tokens per request (prompt + completion), whatever its context window."""
    def complete(prompt, **extra):
        return httpx.post(server.base_url + "/v1/completions", timeout=60,
                          json={"model": "short", "prompt": prompt, "ignore_eos": True, **extra})

    refused(complete(list(range(5, 35)), max_tokens=1), 400, "context_length_exceeded", "prompt")
    refused(complete(list(range(5, 15)), max_tokens=15), 400, "context_length_exceeded", "max_tokens")
    assert complete(list(range(5, 15)), max_tokens=14).json()["usage"]["completion_tokens"] == 14


def test_a_chunked_body_over_the_limit_is_413_without_being_read_whole(server):
    sent = 0

    def body():
        nonlocal sent
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(64 * 1024):   # 64 MiB if it were all read
            sent += 1024
            yield b"a" * 1024

    response = httpx.post(server.base_url + "/v1/chat/completions", content=body(),
                          headers={"content-type": "application/json"}, timeout=60)
    refused(response, 413, "body_too_large", None)
    assert sent < 32 << 20   # the server answered and closed long before the client was done sending
    response = httpx.post(server.base_url + "/v1/chat/completions", content=b"x" * (3 << 20),
                          headers={"content-type": "application/json"}, timeout=60)
    refused(response, 413, "body_too_large", None)


def test_half_a_million_inline_units_are_refused_at_once(server):
    units = {"0": [0] * 500_000}
    payload = json.dumps({"model": "tiny", "messages": CHAT, "restraint": {"name": "x", "hook": "mlp.act",
                                                                          "units": units}}).encode()
    assert len(payload) < 2 << 20
    start = time.perf_counter()
    response = httpx.post(server.base_url + "/v1/chat/completions", content=payload,
                          headers={"content-type": "application/json"}, timeout=60)
    assert time.perf_counter() - start < 1.5   # the check is linear and runs before the units are parsed
    refused(response, 422, "restraint_too_large", "restraint")
    ok = post(server, max_tokens=2, restraint={"name": "x", "hook": "mlp.act", "units": {"0": [1, 2, 3]}})
    assert ok.status_code == 200, ok.text
    refused(post(server, restraint={"name": "x", "hook": "mlp.act", "units": {"0": [1, 1]}}), 422,
            "invalid_restraint", "restraint")


def test_stop_strings_are_counted_and_measured(server):
    refused(post(server, stop=["a", "b", "c"]), 400, "too_many_stops", "stop")
    refused(post(server, stop="x" * 9), 400, "stop_too_long", "stop")
    assert post(server, stop=["x" * 8, "y"], max_tokens=3).status_code == 200


def test_prompts_times_n_is_capped_before_anything_is_built(server):
    refused(post(server, n=9), 400, "too_many_choices", "n")
    many = httpx.post(server.base_url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": [[1, 2]] * 100_000, "max_tokens": 1})
    refused(many, 400, "too_many_choices", "prompt")
    refused(httpx.post(server.base_url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": ["a", "b", "c"], "n": 3}), 400, "too_many_choices", "n")


def test_metadata_size(server):
    refused(post(server, metadata={"note": "x" * 200}), 413, "metadata_too_large", "metadata")
    assert post(server, metadata={"note": "x" * 10}, max_tokens=1).status_code == 200


def test_max_tokens_is_defaulted_and_capped(server):
    out = post(server, ignore_eos=True).json()
    assert out["usage"]["completion_tokens"] == LIMITS["default_max_tokens"]
    refused(post(server, max_tokens=LIMITS["max_new_tokens"] + 1), 400, "max_tokens_too_large", "max_tokens")


def test_the_upstream_engine_sends_the_default_max_tokens(server, tmp_path):
    """Without max_tokens, the proxy's default goes upstream (whose own default is another)."""
    config = {"models": {"proxy": {"engine": "upstream", "base_url": server.base_url + "/v1",
                                   "upstream_model": "tiny"}}, "db": None, "default_max_tokens": 3}
    with running_server(config, workdir=tmp_path) as proxy:
        out = httpx.post(proxy.base_url + "/v1/chat/completions", timeout=60,
                         json={"model": "proxy", "messages": CHAT, "ignore_eos": True}).json()
    assert out["usage"]["completion_tokens"] == 3


def from_address(server, host):
    return httpx.Client(base_url=server.base_url, transport=httpx.HTTPTransport(local_address=host), timeout=60)


def test_one_caller_cannot_take_every_slot(server):
    """Caller A (127.0.0.1) holds its 4 choices in a long stream: its next request is refused, caller B (127.0.0.2)
    still gets in; B's request for more choices than the queue has room for is refused whole, and nothing it asked
    for stays held; once A's stream is closed A gets in again."""
    a, b = from_address(server, "127.0.0.1"), from_address(server, "127.0.0.2")
    long = {"model": "tiny", "messages": CHAT, "n": 4, "max_tokens": 450, "ignore_eos": True, "stream": True}
    with a.stream("POST", "/v1/chat/completions", json=long) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()   # kept: dropping it closes the connection
        next(lines)
        refused(a.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "max_tokens": 1}), 429,
                "key_queue_full", None)
        assert b.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "max_tokens": 1}).status_code == 200
        refused(b.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "max_tokens": 1, "n": 3}),
                429, "queue_full", None)
        two = b.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "max_tokens": 1, "n": 2})
        assert two.status_code == 200, two.text
    for _ in range(100):   # the server sees the disconnect and releases A's share
        out = a.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "max_tokens": 1})
        if out.status_code == 200:
            break
        time.sleep(0.1)
    assert out.status_code == 200, out.text
