"""ASGI middleware: body size limit, in-flight accounting with draining (503), the access log, and the Host
allow-list (400)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from rolemrc.serve.config import is_loopback
from rolemrc.serve.errors import ApiError
from rolemrc.serve.logs import elapsed_ms

log = logging.getLogger("rolemrc.serve.access")


class TooLarge(Exception):
    pass


async def _send_error(send: Any, error: ApiError, close: bool = False) -> None:
    """`close`: and close the connection after it (a body left unread is not read on)."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status,
                "headers": [*headers, (b"connection", b"close")] if close else headers})
    await send({"type": "http.response.body", "body": body})


async def _drain(receive: Any, max_bytes: int, max_s: float = 1.0) -> None:
    """Read and drop what is left of a refused body, up to `max_bytes` more and `max_s` seconds (a lingering close, as
    nginx does): a client still sending then reads the error instead of a reset connection."""
    deadline, seen = time.monotonic() + max_s, 0
    while seen <= max_bytes:
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return
        seen += len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body"):
            return


class BodyLimit:
    """413 for bodies over `max_bytes` (by Content-Length, or counted while streaming in: a chunked body is never kept
    past the limit; at most as much again is read and dropped before the connection is closed)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = ApiError(413, f"request body over {self.max_bytes} bytes", code="body_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _drain(receive, self.max_bytes)
            return await _send_error(send, error, close=True)
        seen = 0
        started = over = False

        async def limited_receive() -> dict:
            nonlocal seen, over
            if over:
                raise TooLarge
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    over = True
                    raise TooLarge
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started
            if over:   # the app's answer to the body it could not read (FastAPI makes it a 400): the 413 instead
                if not started:
                    started = True
                    await _drain(receive, self.max_bytes)
                    await _send_error(send, error, close=True)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except TooLarge:
            if not started:
                await _drain(receive, self.max_bytes)
                await _send_error(send, error, close=True)


class Lifecycle:
    """Counts requests in flight (the drain waits for zero), answers 503 to API calls while
    draining, and writes one JSON access-log line per request when its last byte is sent."""

    def __init__(self, app: Any, state: Any) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500
        path = scope["path"]
        if self.state.draining and path.startswith("/v1/"):
            error = ApiError(503, "the server is shutting down; retry on another instance", code="shutting_down")
            await _send_error(send, error)
            return log.info("request", extra={"method": scope["method"], "path": path, "status": 503, "ms": 0.0})
        scope.setdefault("state", {})
        scope["state"]["log"] = info = {}

        async def logged_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.state.inflight += 1
        try:
            await self.app(scope, receive, logged_send)
        finally:
            self.state.inflight -= 1
            if path not in ("/health", "/metrics"):
                log.info("request", extra={"method": scope["method"], "path": path, "status": status,
                                           "ms": elapsed_ms(start), **info})


def host_name(header: str) -> str:
    """The name a Host header gives, lower-cased, without its port or an IPv6 address's brackets."""
    value = header.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    return value.rpartition(":")[0] if value.count(":") == 1 else value


class HostCheck:
    """400 `host_not_allowed` before routing for a Host header naming neither a loopback name nor one of `names`
    (`*.x.org`: its subdomains): a web page whose DNS name was rebound to this address cannot reach the API."""

    def __init__(self, app: Any, names: frozenset[str]) -> None:
        self.app, self.names = app, names
        self.suffixes = tuple(name[1:] for name in names if name.startswith("*."))

    def allowed(self, header: str) -> bool:
        name = host_name(header).rstrip(".")
        return is_loopback(name) or name in self.names or name.endswith(self.suffixes)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if not self.allowed(header):
            error = ApiError(400, f"Host {header[:100]!r} is not served here: add its name to allowed_hosts in the "
                                  "serve config", code="host_not_allowed")
            return await _send_error(send, error, close=True)
        await self.app(scope, receive, send)
