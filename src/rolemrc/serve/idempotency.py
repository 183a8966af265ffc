"""Idempotency keys on experiment requests: a retry sent with the same `Idempotency-Key` header is answered from
the first attempt's stored response (`Idempotent-Replayed: true`) instead of generating and logging again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from rolemrc.serve.errors import ApiError, database_refused
from rolemrc.serve.protocol import sse
from rolemrc.serve.store import Store, StoreError

HEADER = "Idempotency-Key"
MAX_KEY_CHARS = 255
STATUS_OF_TYPE = {"cancelled": 499, "server_error": 500, "service_unavailable": 503, "timeout_error": 504}


def header(request: Request) -> str | None:
    """The request's key (400 when empty or over MAX_KEY_CHARS), or None."""
    key = request.headers.get(HEADER)
    if key is not None and not 0 < len(key) <= MAX_KEY_CHARS:
        raise ApiError(400, f"{HEADER} must have 1 to {MAX_KEY_CHARS} characters, got {len(key)}",
                       code="invalid_idempotency_key", param=HEADER)
    return key


async def claim(store: Store, experiment: str, key: str, stale_after_s: float) -> dict[str, Any] | None:
    """None when this request now holds the key; the stored response when the key is done; 409 while another
    request with it is running (a claim older than `stale_after_s` is taken over: no request runs that long)."""
    try:
        held = await asyncio.to_thread(store.claim, experiment, key, stale_after_s)
    except StoreError as exc:
        raise database_refused(exc) from exc
    if held is None:
        return None
    if held["status"] == "running":
        raise ApiError(409, f"a request with this {HEADER} is still running", code="idempotency_key_in_use",
                       param=HEADER)
    return held["response"]


async def release(store: Store, experiment: str, key: str) -> None:
    """Drop the claim of a request refused before it reached the engine."""
    try:
        await asyncio.to_thread(store.release_claim, experiment, key)
    except StoreError as exc:
        raise database_refused(exc) from exc


def replay(stored: dict[str, Any], stream: bool, include_usage: bool, chunk_model: type[BaseModel],
           deltas: Callable[[dict[str, Any]], list[BaseModel]]) -> Response:
    """A stored response again: an error with the status it had (only server-side failures are stored), a whole
    response as is or, for a request that streams, as server-sent events (`deltas` turns a whole choice into its
    streamed ones)."""
    headers = {"Idempotent-Replayed": "true"}
    if "error" in stored:
        return JSONResponse(stored, status_code=STATUS_OF_TYPE.get(stored["error"]["type"], 500), headers=headers)
    if not stream:
        return JSONResponse(stored, headers=headers)

    async def events() -> AsyncIterator[str]:
        chunk = {k: stored.get(k) for k in ("id", "created", "model", "restraint", "experiment", "arm")}
        for choice in stored["choices"]:
            for delta in deltas(choice):
                yield sse(chunk_model(**chunk, choices=[delta]).model_dump(exclude_none=True))
        if include_usage:
            yield sse(chunk_model(**chunk, choices=[], usage=stored["usage"]).model_dump(exclude_none=True))
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
