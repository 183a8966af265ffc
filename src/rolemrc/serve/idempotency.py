"""Idempotency keys on experiment requests: a retry sent with the same `Idempotency-Key` header, by the same caller and
with the same body, is answered from the first attempt's stored response (`Idempotent-Replayed: true`) instead of
generating and logging again. A key belongs to its caller (`state.caller_id`: the API key the request authenticated
with, else a hash of the client's address, as its A/B rows say), so another caller's key of the same name is another
key; the same caller reusing a key for another body gets 422 `idempotency_key_reused`. Only a final answer (200) is
stored: an outcome that tells its client to retry (a 5xx, 499, 504, shutdown, ...) frees the key, as does a request
refused before it reached the engine (both in the transaction that logs its rows). Each claim carries a fencing
token, so a request whose claim was taken over cannot overwrite the answer stored under the key."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from rolemrc.serve.errors import ApiError, database_refused
from rolemrc.serve.protocol import sse
from rolemrc.serve.state import caller_id
from rolemrc.serve.store import Claim, Store, StoreError

HEADER = "Idempotency-Key"
MAX_KEY_CHARS = 255
DELIVERY = {"stream", "stream_options"}   # how the answer is delivered, not what it is: left out of the body's hash


def header(request: Request) -> str | None:
    """The request's key (400 when empty or over MAX_KEY_CHARS), or None."""
    key = request.headers.get(HEADER)
    if key is not None and not 0 < len(key) <= MAX_KEY_CHARS:
        raise ApiError(400, f"{HEADER} must have 1 to {MAX_KEY_CHARS} characters, got {len(key)}",
                       code="invalid_idempotency_key", param=HEADER)
    return key


def body_hash(body: BaseModel) -> str:
    """sha256 of the parsed body as canonical JSON (sorted keys, defaults filled in), without DELIVERY: a retry that
    asks to stream what was answered whole is the same request."""
    canonical = json.dumps(body.model_dump(mode="json", exclude=DELIVERY), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


async def claim(store: Store, request: Request, body: BaseModel, experiment: str, key: str,
                stale_after_s: float) -> Claim | dict[str, Any]:
    """The `Claim` when this request now holds its caller's key; the stored response when the key is done; 422 when
    the caller sent the key with another body; 409 while another request with it is running (a claim older than
    `stale_after_s` is taken over: no request runs that long)."""
    digest = body_hash(body)
    try:
        held = await asyncio.to_thread(store.claim, experiment, caller_id(request), key, digest, stale_after_s)
    except StoreError as exc:
        raise database_refused(exc) from exc
    if isinstance(held, Claim):
        return held
    if held["body"] != digest:
        raise ApiError(422, f"this {HEADER} was already used with a different request body; send a new key for a "
                            "new request", code="idempotency_key_reused", param=HEADER)
    if held["status"] == "running":
        raise ApiError(409, f"a request with this {HEADER} is still running", code="idempotency_key_in_use",
                       param=HEADER)
    return held["response"]


def replay(stored: dict[str, Any], stream: bool, include_usage: bool, chunk_model: type[BaseModel],
           deltas: Callable[[dict[str, Any]], list[BaseModel]]) -> Response:
    """A stored response (only whole 200 answers are stored) again: as is or, for a request that streams, as
    server-sent events (`deltas` turns a whole choice into its streamed ones)."""
    headers = {"Idempotent-Replayed": "true"}
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
