"""`rolemrc bench attacks`: what one hostile request costs a real `rolemrc serve` (issue 44, "one request can stall or
exhaust the server").

A steady stream (one streaming chat request of `STREAM_TOKENS` tokens with `ignore_eos`, sent again as each one ends)
runs throughout; its inter-token gaps before any attack are the baseline. Each attack is then sent once while it runs
and recorded: the answer's status, error code and param, seconds to answer (or "timed out" after the client's
timeout), the server's RSS growth (VmRSS sampled every 10 ms; only when the bench started the server and knows its
pid) and the stream's p50 / max gap over the attack's window (at least `MIN_WINDOW_S`). A server that no longer
answers /health after an attack is killed and started again (`server_restarted`); one whose RSS grows past
`rss_cap_mb` during an attack is killed there (`rss_cap_hit`), so the machine survives the measurement."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx

from rolemrc.serve.launch import Server, start_server

CHAT = [{"role": "user", "content": "the keeper of the lighthouse"}]
STREAM_TOKENS = 200
MIN_WINDOW_S = 1.0
BODY_BYTES = (1 << 20) - 4096   # payloads just under the default max_body_bytes: the attack is what the body holds
EXPERIMENT = "attacks"
KEYS = ("KEY1", "KEY2")   # KEY1 attacks and floods; KEY2 streams and sends the one request beside the flood


def compact(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


# --- the attacks' bodies (the tests send the same ones) ---

def inline_units_body(model: str, size: int = BODY_BYTES) -> bytes:
    """An inline restraint whose units are ~`size` bytes of zeros (duplicates, ~size/2 units)."""
    head = compact({"model": model, "messages": CHAT, "max_tokens": 1,
                    "restraint": {"name": "zeros", "hook": "mlp.act", "factor": 0.5, "units": {"0": [0]}}})
    return head.replace(b"[0]", b"[" + b",".join([b"0"] * ((size - len(head)) // 2)) + b"]")


def chunked_body(model: str, size: int) -> Iterator[bytes]:
    """`size` bytes sent with Transfer-Encoding: chunked (no Content-Length), 64 KiB at a time."""
    head = b'{"model":"' + model.encode() + b'","messages":[],"pad":"'
    yield head
    left = size - len(head)
    while left > 0:
        yield b"0" * min(left, 1 << 16)
        left -= 1 << 16


def long_stops_body(model: str, chars: int = 8192) -> dict[str, Any]:
    """4 stop strings of `chars` characters that never match, 200 tokens with ignore_eos."""
    return {"model": model, "messages": CHAT, "max_tokens": STREAM_TOKENS, "ignore_eos": True,
            "stop": [letter * chars for letter in "qxzj"]}


def prompts_times_n_body(model: str, size: int = BODY_BYTES, n: int = 128) -> bytes:
    """~`size` bytes of 4-token token-id prompts, each asked for `n` choices."""
    head = compact({"model": model, "prompt": [[1, 1, 1, 1]], "n": n, "max_tokens": 1})
    one = b"[1,1,1,1]"
    count = (size - len(head)) // (len(one) + 1) + 1
    return head.replace(b"[[1,1,1,1]]", b"[" + b",".join([one] * count) + b"]")


def no_max_tokens_body(model: str) -> dict[str, Any]:
    return {"model": model, "messages": CHAT, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def echo_logprobs_body(model: str, context: int) -> dict[str, Any]:
    """A token-id prompt filling the context window but one token, echoed with its log-probabilities."""
    return {"model": model, "prompt": [1] * (context - 1), "max_tokens": 1, "echo": True, "logprobs": 5}


def metadata_body(model: str, size: int = 64 << 10) -> dict[str, Any]:
    return {"model": model, "messages": CHAT, "max_tokens": 1, "experiment": EXPERIMENT, "user": "attacker",
            "metadata": {"blob": "x" * size}}


def flood_body(model: str) -> dict[str, Any]:
    return {"model": model, "messages": CHAT, "max_tokens": STREAM_TOKENS, "ignore_eos": True}


# --- measuring ---

def rss_mb(pid: int) -> float | None:
    """VmRSS of `pid` in MB (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


class Background:
    """`_run` in a daemon thread for the length of a `with` block, until `_stop` is set."""

    def __enter__(self) -> Self:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        raise NotImplementedError


class RssSampler(Background):
    """VmRSS of the server every 10 ms in a thread; `growth_mb()` is its peak growth since `mark()`; past `cap_mb`
    of growth the server is SIGKILLed (`capped` says it was)."""

    def __init__(self, pid: Callable[[], int | None], cap_mb: float) -> None:
        self.pid, self.cap_mb = pid, cap_mb
        self.start_mb: float | None = None
        self.peak_mb: float | None = None
        self.capped = False

    def mark(self) -> None:
        pid = self.pid()
        self.start_mb = self.peak_mb = rss_mb(pid) if pid else None
        self.capped = False

    def growth_mb(self) -> float | None:
        return None if self.start_mb is None or self.peak_mb is None else round(self.peak_mb - self.start_mb, 1)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            pid = self.pid()
            now = rss_mb(pid) if pid else None
            if now is None or self.start_mb is None:
                continue
            self.peak_mb = max(self.peak_mb or now, now)
            if now - self.start_mb > self.cap_mb and not self.capped:
                self.capped = True
                os.kill(pid, signal.SIGKILL)


@dataclass
class Stream(Background):
    """Streaming chat requests one after another in a thread; `tokens` holds (request number, arrival time)."""

    base_url: str
    model: str
    key: str
    tokens: list[tuple[int, float]] = field(default_factory=list)

    def _run(self) -> None:
        body = {"model": self.model, "messages": CHAT, "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True}
        headers = {"Authorization": f"Bearer {self.key}"}
        number = 0
        while not self._stop.is_set():
            number += 1
            try:
                with httpx.stream("POST", self.base_url + "/v1/chat/completions", json=body, headers=headers,
                                  timeout=httpx.Timeout(600, connect=5)) as reply:
                    if reply.status_code != 200:   # refused (a full queue): try again shortly
                        self._stop.wait(0.2)
                        continue
                    for line in reply.iter_lines():
                        if self._stop.is_set():
                            return
                        if line.startswith("data: {") and '"content"' in line:
                            self.tokens.append((number, time.perf_counter()))
            except httpx.HTTPError:
                self._stop.wait(0.2)

    def wait_for(self, count: int, timeout: float = 300) -> None:
        deadline = time.perf_counter() + timeout
        while len(self.tokens) < count:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the stream got {len(self.tokens)} tokens in {timeout} s")
            time.sleep(0.05)

    def gaps(self, start: float, end: float) -> dict[str, float | None]:
        """p50 / max ms between tokens of one request arriving in [start, end]; the time since the last token
        at `end` counts too (a stream that stalled has no gaps, only that)."""
        tokens = list(self.tokens)
        gaps = [t - before for (n0, before), (n1, t) in itertools.pairwise(tokens) if n0 == n1 and start <= t <= end]
        last = max((t for _, t in tokens if t <= end), default=start)
        gaps.append(end - max(last, start))
        return {"stream_gap_p50_ms": round(1000 * statistics.median(gaps), 1),
                "stream_gap_max_ms": round(1000 * max(gaps), 1)}


async def aiter_of(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


async def ask(client: httpx.AsyncClient, path: str, key: str, timeout: float, body: Any = None,
              method: str = "POST") -> dict[str, Any]:
    """status, code, param and seconds of one request ("timed out" / "connection error" as its status)."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else aiter_of(body) if isinstance(body, Iterator) else None
    start = time.perf_counter()
    try:
        reply = await client.request(method, path, headers=headers, content=content,
                                     json=body if isinstance(body, dict) else None, timeout=timeout)
    except httpx.TimeoutException:
        return {"status": "timed out", "code": None, "param": None, "seconds": round(time.perf_counter() - start, 3)}
    except httpx.HTTPError as exc:
        return {"status": "connection error", "code": type(exc).__name__, "param": None,
                "seconds": round(time.perf_counter() - start, 3)}
    seconds = round(time.perf_counter() - start, 3)
    try:
        error = reply.json().get("error") or {}
    except ValueError:
        error = {}
    return {"status": reply.status_code, "code": error.get("code"), "param": error.get("param"), "seconds": seconds}


async def streamed_tokens(client: httpx.AsyncClient, body: dict[str, Any], key: str, cap_s: float) -> dict[str, Any]:
    """A streaming request read for at most `cap_s`: status, tokens generated (the final usage, else the content
    chunks received), whether it finished."""
    start, tokens, finished, status = time.perf_counter(), 0, False, None

    async def read() -> None:
        nonlocal tokens, finished, status
        async with client.stream("POST", "/v1/chat/completions", json=body, timeout=cap_s + 5,
                                 headers={"Authorization": f"Bearer {key}"}) as reply:
            status = reply.status_code
            async for line in reply.aiter_lines():
                chunk = json.loads(line[6:]) if line.startswith("data: {") else {}
                tokens = (chunk.get("usage") or {}).get("completion_tokens") or tokens + bool(chunk.get("choices"))
                finished = finished or line == "data: [DONE]"

    with contextlib.suppress(TimeoutError, httpx.HTTPError):
        await asyncio.wait_for(read(), cap_s)
    return {"status": status, "code": None, "param": None, "seconds": round(time.perf_counter() - start, 3),
            "tokens": tokens, "finished": finished, "capped_at_s": cap_s}


async def admitted(client: httpx.AsyncClient, body: dict[str, Any], key: str, timeout: float) -> dict[str, Any]:
    """Whether a streaming request gets in: its status when the answer starts (a stream starts once admitted), then
    it is dropped."""
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}, timeout=timeout,
                                 headers={"Authorization": f"Bearer {key}"}) as reply:
            error = json.loads(await reply.aread()).get("error", {}) if reply.status_code != 200 else {}
            return {"status": reply.status_code, "code": error.get("code"), "param": error.get("param"),
                    "seconds": round(time.perf_counter() - start, 3)}
    except httpx.TimeoutException:
        return {"status": "timed out", "code": None, "param": None, "seconds": round(time.perf_counter() - start, 3)}


async def flood(client: httpx.AsyncClient, model: str, count: int, timeout: float) -> dict[str, Any]:
    """KEY1 sends `count` long requests at once; 0.5 s later KEY2 sends one: whether it gets in, and KEY1's
    answers by status (those still generating 0.5 s after KEY2's answer are dropped, counted as admitted)."""
    floods = [asyncio.create_task(ask(client, "/v1/chat/completions", KEYS[0], timeout, flood_body(model)))
              for _ in range(count)]
    await asyncio.sleep(0.5)
    second = await admitted(client, flood_body(model), KEYS[1], timeout)
    await asyncio.sleep(0.5)
    by_status: dict[str, int] = {}
    for task in floods:
        label = "admitted" if not task.done() else f"{task.result()['status']} {task.result()['code'] or ''}".strip()
        by_status[label] = by_status.get(label, 0) + 1
        task.cancel()
    await asyncio.gather(*floods, return_exceptions=True)
    return {**second, "flood": by_status}


async def raw_request(base_url: str, path: str, key: str, body: dict[str, Any], *, extra: str = "",
                      rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A request written on a socket of its own (to leave before its answer, or never read it): its reader and
    writer. `rcvbuf`: a small receive buffer, so the server's sends block once it is full."""
    import socket

    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock)
    payload = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\nContent-Type: "
                 f"application/json\r\n{extra}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    await writer.drain()
    return reader, writer


async def abandoned_streams(client: httpx.AsyncClient, base_url: str, model: str, timeout: float,
                            count: int = 16) -> dict[str, Any]:
    """KEY1 sends `count` streamed n=8 experiment requests, each with an Idempotency-Key, and closes each socket
    at once (before the first byte, as a client that gave up would); a second later it sends 8 n=8 requests at once,
    its whole share of the queue (max_queue_per_key 64): all are served unless something of the abandoned ones (a
    slot, the key's share) is still held."""
    body = {"model": model, "messages": CHAT, "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True, "n": 8,
            "temperature": 0.5, "experiment": EXPERIMENT, "user": "abandon"}
    for k in range(count):
        _, writer = await raw_request(base_url, "/v1/chat/completions", KEYS[0], body,
                                      extra=f"Idempotency-Key: abandon-{k}-{time.time_ns()}\r\n")
        writer.close()
    await asyncio.sleep(1.0)
    retried = await asyncio.gather(*(ask(client, "/v1/chat/completions", KEYS[0], max(timeout, 60),
                                         {**body, "stream": False, "max_tokens": 4, "user": f"again-{k}"})
                                     for k in range(8)))
    return {"status": "refused" if any(r["status"] == 429 for r in retried) else "served",   # 429: something held
            "code": None, "param": None, "seconds": max(r["seconds"] for r in retried),
            "retried_by_status": {str(s): sum(r["status"] == s for r in retried) for s in {r["status"] for r in retried}}}


async def long_prompt(client: httpx.AsyncClient, model: str, context: int, timeout: float) -> dict[str, Any]:
    """One prompt at the server's context window (default settings: no max_model_len) and one past it."""
    fits = await ask(client, "/v1/completions", KEYS[0], timeout,
                     {"model": model, "prompt": [5 + i % 200 for i in range(context - 8)], "max_tokens": 4})
    over = await ask(client, "/v1/completions", KEYS[0], timeout,
                     {"model": model, "prompt": [5 + i % 200 for i in range(4 * context)], "max_tokens": 4})
    return {**fits, "over_the_window": over}


async def registration_flood(base_url: str, timeout: float, count: int = 300) -> dict[str, Any]:
    """KEY1 (admin) registers `count` distinct restraints: how many are taken before the server's limit refuses.
    Every request on a new connection: a pooled one left idle past the server's keep-alive while a slow batch ends can
    be closed by the server as it is reused (a ReadError that says nothing of the limit)."""
    start = time.perf_counter()
    answers = []
    async with httpx.AsyncClient(base_url=base_url, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for lo in range(0, count, 32):   # 32 in flight
            answers += await asyncio.gather(*(ask(client, "/v1/restraints", KEYS[0], timeout, {
                "name": f"flood-{k}", "spec": {"hook": "mlp.act", "factor": 0.0, "units": {"0": [k % 64]}}})
                for k in range(lo, min(count, lo + 32))))
        for lo in range(0, count, 32):   # leave the server as it was
            await asyncio.gather(*(client.delete(f"/v1/restraints/flood-{k}",
                                                 headers={"Authorization": f"Bearer {KEYS[0]}"})
                                   for k in range(lo, min(count, lo + 32))))
    by_status: dict[str, int] = {}
    for a in answers:
        label = f"{a['status']} {a['code'] or ''}".strip()
        by_status[label] = by_status.get(label, 0) + 1
    return {"status": "limited" if any(a["status"] == 422 for a in answers) else "unlimited", "code": None,
            "param": None, "seconds": round(time.perf_counter() - start, 3), "registrations": by_status}


async def slow_reader(client: httpx.AsyncClient, base_url: str, model: str, timeout: float,
                      request_timeout: float) -> dict[str, Any]:
    """`KEY2` sends a streamed n=16 request with top-20 logprobs (megabytes of events) on a socket with a 4 KB receive
    buffer that is never read. 3 s past the server's `request_timeout_s` it sends three n=16 requests at once: with
    the stream's one choice they fit its `max_queue_per_key` (64) only if the reader's 16 were let go (else 429)."""
    body = {"model": model, "messages": CHAT, "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True, "n": 16,
            "temperature": 0.5, "logprobs": True, "top_logprobs": 20}
    start = time.perf_counter()
    _, writer = await raw_request(base_url, "/v1/chat/completions", KEYS[1], body, rcvbuf=4096)
    await asyncio.sleep(request_timeout + 3)
    probe = {"model": model, "messages": CHAT, "max_tokens": 1, "n": 16, "temperature": 0.5}
    answers = await asyncio.gather(*(ask(client, "/v1/chat/completions", KEYS[1], timeout, probe) for _ in range(3)))
    writer.close()
    held = any(a["status"] == 429 for a in answers)
    return {"status": "still held" if held else "cut off", "code": None, "param": None,
            "seconds": round(time.perf_counter() - start, 3), "request_timeout_s": request_timeout,
            "probes": [f"{a['status']} {a['code'] or ''}".strip() for a in answers]}


# --- the run ---

@dataclass
class Target:
    """The server attacked: one the bench started (`server`, restarted when it stops answering) or a given URL."""

    base_url: str
    server: Server | None = None
    restarts: int = 0

    @property
    def pid(self) -> int | None:
        return self.server.proc.pid if self.server and self.server.proc.poll() is None else None

    def healthy(self) -> bool:
        try:
            return httpx.get(self.base_url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def revive(self) -> bool:
        """Kill and start again a server that stopped answering (True when it had to)."""
        if self.server is None or self.healthy():
            return False
        self.server.proc.kill()
        self.server.wait(30)
        self.server = start_server(self.server.config, workdir=self.server.config.parent, port=self.server.port,
                                   timeout=300)
        self.restarts += 1
        return True


ATTACKS = ("chunked_body", "long_stops", "no_max_tokens", "echo_logprobs_at_window", "metadata", "key_flood",
           "abandoned_streams", "long_prompt", "registration_flood", "slow_reader",
           "prompts_times_n", "inline_units")   # the ones that may leave the server hung or killed last
REQUEST_TIMEOUT_S = 30.0   # the started server's request_timeout_s: the slow reader is held about this long


def attacks(model: str, context: int, max_queue: int, timeout: float, base_url: str,
            request_timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Callable[[httpx.AsyncClient], Any]]:
    """Each attack's coroutine factory; `inline_units` also answers for `health_during_inline_units`."""
    chat, text = "/v1/chat/completions", "/v1/completions"

    async def inline_units(client: httpx.AsyncClient) -> dict[str, Any]:
        async def health() -> dict[str, Any]:
            await asyncio.sleep(0.2)
            return await ask(client, "/health", KEYS[0], timeout, method="GET")
        units, during = await asyncio.gather(ask(client, chat, KEYS[0], timeout, inline_units_body(model)), health())
        return {"inline_units": units, "health_during_inline_units": during}

    async def long_stops(client: httpx.AsyncClient) -> dict[str, Any]:
        answer = await ask(client, chat, KEYS[0], timeout, long_stops_body(model))
        return answer | {"ms_per_token": round(1000 * answer["seconds"] / STREAM_TOKENS, 2)
                         if answer["status"] == 200 else None}

    return {   # in the order of ATTACKS
        "chunked_body": lambda c: ask(c, chat, KEYS[0], timeout, chunked_body(model, BODY_BYTES + (1 << 20))),
        "long_stops": long_stops,
        "no_max_tokens": lambda c: streamed_tokens(c, no_max_tokens_body(model), KEYS[0], timeout),
        "echo_logprobs_at_window": lambda c: ask(c, text, KEYS[0], timeout, echo_logprobs_body(model, context)),
        "metadata": lambda c: ask(c, chat, KEYS[0], timeout, metadata_body(model)),
        "key_flood": lambda c: flood(c, model, max_queue, timeout),
        "abandoned_streams": lambda c: abandoned_streams(c, base_url, model, timeout),
        "long_prompt": lambda c: long_prompt(c, model, context, timeout),
        "registration_flood": lambda c: registration_flood(base_url, timeout),
        "slow_reader": lambda c: slow_reader(c, base_url, model, timeout, request_timeout),
        "prompts_times_n": lambda c: ask(c, text, KEYS[0], timeout, prompts_times_n_body(model)),
        "inline_units": inline_units,
    }


def attack_once(name: str, make: Callable[[httpx.AsyncClient], Any], target: Target, stream: Stream,
                sampler: RssSampler) -> dict[str, dict[str, Any]]:
    """One attack while the stream runs: its answers, with RSS growth and the stream's gaps over its window."""
    async def go() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=target.base_url, limits=httpx.Limits(max_connections=None)) as client:
            return await make(client)

    sampler.mark()
    start = time.perf_counter()
    answers = asyncio.run(go())
    answers = answers if name in answers else {name: answers}
    end = max(time.perf_counter(), start + MIN_WINDOW_S)
    time.sleep(max(0.0, end - time.perf_counter()))
    shared = {"rss_growth_mb": sampler.growth_mb(), **stream.gaps(start, end)}
    if sampler.capped:
        shared["rss_cap_hit"] = True
    if target.revive():
        shared["server_restarted"] = True
        stream.wait_for(len(stream.tokens) + 2 * STREAM_TOKENS)   # the new server warmed up before the next attack
    return {k: v | shared for k, v in answers.items()}


def start_target(model_dir: Path, root: Path, max_queue: int, request_timeout: float = REQUEST_TIMEOUT_S) -> Target:
    """A server on `model_dir` as the bench attacks it (its files in `root`): keys KEY1 (admin) and KEY2, inline
    restraints, an A/B database with the experiment `attacks`, room for `max_queue` requests."""
    config = {"models": {"tiny": {"path": str(model_dir)}}, "allow_inline_restraints": True, "db": "ab.sqlite",
              "api_key_file": "keys.txt", "max_queue": max_queue, "max_batch": 8, "max_new_tokens": 512,
              "request_timeout_s": request_timeout, "log_level": "warning"}
    (root / "keys.txt").write_text(f"{KEYS[0]} admin\n{KEYS[1]}\n")   # KEY1 creates the experiment
    server = start_server(config, workdir=root, timeout=300)
    target = Target(server.base_url, server)
    httpx.post(target.base_url + "/v1/experiments", timeout=30, headers={"Authorization": f"Bearer {KEYS[0]}"},
               json={"id": EXPERIMENT, "arms": [{"name": "a", "model": "tiny"}]}).raise_for_status()
    return target


def run(model: Path | None = None, base_url: str | None = None, served_model: str | None = None,
        context: int | None = None, max_queue: int = 128, timeout: float = 30.0, rss_cap_mb: float = 2048,
        baseline_s: float = 3.0, only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every attack (or those in `only`) against a server this starts (on `model`, default a random-init demo Llama;
    keys KEY1 and KEY2) or the one at `base_url` (whose keys must be KEY1 and KEY2, with an experiment `attacks`)."""
    from rolemrc.bench.common import make_model_dir
    from rolemrc.core.errors import InputError
    from rolemrc.core.modeling import resolve_model

    unknown = sorted(set(only) - set(ATTACKS))
    if unknown:
        raise InputError(f"--only: unknown attack(s) {unknown}; choose from {', '.join(ATTACKS)}")
    model = resolve_model(model).resolve() if model is not None else None
    load = [round(x, 2) for x in os.getloadavg()]   # the machine's other work skews every timing
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if base_url is None:
            model_dir = model or make_model_dir("demo", root)
            target = start_target(model_dir, root, max_queue)
            window = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings", 2048)
            context, served_model = context or window, "tiny"
        else:
            target = Target(base_url.rstrip("/").removesuffix("/v1"))
            served_model = served_model or httpx.get(target.base_url + "/v1/models", timeout=30, headers={
                "Authorization": f"Bearer {KEYS[0]}"}).json()["data"][0]["id"]
            context = context or 2048
        every = attacks(served_model, context, max_queue, timeout, target.base_url)
        chosen = {k: v for k, v in every.items() if not only or k in only}
        results: dict[str, Any] = {}
        try:
            with RssSampler(lambda: target.pid, rss_cap_mb) as sampler, \
                    Stream(target.base_url, served_model, KEYS[1]) as stream:
                stream.wait_for(10)
                start = time.perf_counter()
                time.sleep(baseline_s)
                baseline = stream.gaps(start, time.perf_counter())
                for name, make in chosen.items():
                    results |= attack_once(name, make, target, stream, sampler)
        finally:
            if target.server is not None:
                target.server.proc.kill()
                target.server.wait(30)
    return {"benchmark": "attacks", "server": "started by the bench" if target.server else target.base_url,
            "model": str(model) if model else ("random-init demo Llama" if base_url is None else served_model),
            "context_window": context, "max_queue": max_queue, "timeout_s": timeout, "rss_cap_mb": rss_cap_mb,
            "body_bytes": BODY_BYTES, "stream_tokens": STREAM_TOKENS, "baseline": baseline,
            "server_restarts": target.restarts, "load_average_at_start": load, "attacks": results}
