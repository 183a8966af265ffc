"""How a request (`completions.Call`) ends: `Ended` when it cannot complete (why, and what its client hears), its
whole body rendered before anything is committed, and its A/B rows: one per choice it asked for, all of them written
in one transaction with its idempotency key settled (the answer stored under it, or the key freed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import anyio

from rolemrc.serve.errors import ApiError, database_refused
from rolemrc.serve.state import caller_id
from rolemrc.serve.store import Claim, Store, StoreError

log = logging.getLogger("rolemrc.serve")


class Ended(Exception):
    """A request that cannot complete: why (its rows' finish_reason) and the error its client gets."""

    def __init__(self, reason: str, error: ApiError) -> None:
        super().__init__(reason)
        self.reason, self.error = reason, error


def shut_down() -> Ended:
    return Ended("shutdown", ApiError(503, "the server shut down before the request finished", code="shutting_down"))


def internal_error(exc: Exception) -> ApiError:
    log.error("request failed", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}")


def disconnected() -> ApiError:
    return ApiError(499, "client disconnected", type="cancelled")


def render(body: dict[str, Any]) -> bytes:
    """A whole response as JSON; output that cannot render (NaN, inf) is a failed generation, refused before its
    rows are committed as a success."""
    try:
        return json.dumps(body, allow_nan=False).encode()
    except ValueError:
        raise Ended("error", ApiError(500, "generation failed: the output is not finite",
                                      code="generation_failed")) from None


def refusal(error: ApiError) -> str:
    """The finish_reason of a request that failed before its engine admitted it (its arm already assigned): `refused`
    for a 4xx (the arm's limits or engine turned it away: context_length_exceeded, queue_full, key_queue_full,
    max_tokens_too_large, unsupported_parameter, ...), `shutdown` when the server is stopping, else `error`."""
    if error.status < 500:
        return "refused"
    return "shutdown" if error.code == "shutting_down" else "error"


def rows(call: Any, reason: str | None, failed: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The rows of `call` (a `completions.Call`): one per choice (id `<id>` for a single choice, else
    `<id>:<index>`, each with `request_id` `<id>`) with the text generated so far and the caller that sent it;
    `reason`: the finish_reason of every row when the request did not complete (`failed`: the error its client got,
    whose message goes in `error`, and its code, or its type when it has none, in `error_code`), else each choice's
    own. A request that failed before admission (refused included) gets a row per choice it asked for, with no
    text."""
    n, latency, finished = call.body.n, time.perf_counter() - call.clock, time.time()
    if call.choices:
        asked = [(c.index, c.prompt, out.text, c.gen) for c, out in zip(call.choices, call.outs)]
    else:
        asked = [(i * n + k, prompt, "", None) for i, prompt in enumerate(call.prompts) for k in range(n)]
    error, code = (failed.get("message"), failed.get("code") or failed.get("type")) if failed else (None, None)
    who = caller_id(call.request)
    out = []
    for index, prompt, text, gen in asked:
        final = gen.final if gen is not None else None
        out.append({"id": call.id if len(asked) == 1 else f"{call.id}:{index}", "request_id": call.id,
                    "idempotency_key": call.key, "error": error, "error_code": code, "caller": who,
                    "experiment": call.route.experiment, "arm": call.route.arm, "user": call.body.user,
                    "model": call.route.model_id, "restraint": call.restraint(), "endpoint": call.endpoint,
                    "messages": call.logged_messages(prompt), "response": text,
                    "finish_reason": reason or final.finish_reason, "latency_s": latency,
                    "prompt_tokens": gen.prompt_tokens if gen is not None else 0,
                    "completion_tokens": final.completion_tokens if final else 0, "metadata": call.body.metadata,
                    "started": call.started, "finished": finished})
    return out


async def write(store: Store, logged: list[dict[str, Any]], claim: Claim | None,
                response: dict[str, Any] | None) -> None:
    """`Store.log_request` off the event loop, finished even while the request's task is being cancelled (a
    disconnect, the shutdown): the rows, and the idempotency key settled (`response`: the final answer it replays,
    or None to free it). 503 with the store's code when the database refuses; the key is then freed if the database
    still answers (else its claim goes stale and is taken over), so the retry the client was told to send runs."""
    try:
        with anyio.CancelScope(shield=True):
            if not await asyncio.to_thread(store.log_request, logged, claim, response):
                log.warning("idempotency key taken over by another request: its stored answer is kept, this "
                            "request's rows are logged", extra={"id": logged[0]["request_id"] if logged else None})
    except Exception as exc:
        if claim is not None:
            with anyio.CancelScope(shield=True), contextlib.suppress(StoreError):
                await asyncio.to_thread(store.release_claim, claim)
        if isinstance(exc, StoreError):
            raise database_refused(exc) from exc
        raise
