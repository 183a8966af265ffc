"""Bounded work per request (docs/serve.md "Limits"): `check_limits`, what a request may ask for, checked before anything
is built, tokenized or queued; `key_share`, how much of a model's queue one caller may hold."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

from fastapi import Request

from rolemrc.serve import protocol as p
from rolemrc.serve.config import ServeConfig
from rolemrc.serve.errors import ApiError
from rolemrc.serve.state import State, caller_id


def check_limits(config: ServeConfig, body: p.SamplingFields, prompts: int) -> None:
    """400/413 naming the field for a request over the server's limits on work per request (stop strings, choices,
    metadata), checked before anything is built, tokenized or queued."""
    stops = body.stops()
    if len(stops) > config.max_stop_strings:
        raise ApiError(400, f"{len(stops)} stop strings; this server takes at most {config.max_stop_strings}",
                       code="too_many_stops", param="stop")
    if any(len(s) > config.max_stop_chars for s in stops):
        raise ApiError(400, f"a stop string is over this server's limit of {config.max_stop_chars} characters",
                       code="stop_too_long", param="stop")
    if prompts * body.n > config.max_choices:
        raise ApiError(400, f"{prompts} prompt(s) x n={body.n} asks for {prompts * body.n} choices; this server "
                            f"takes at most {config.max_choices} per request", code="too_many_choices",
                       param="n" if body.n > 1 else "prompt")
    if body.metadata is not None and len(json.dumps(body.metadata).encode()) > config.max_metadata_bytes:
        raise ApiError(413, f"metadata is over this server's limit of {config.max_metadata_bytes} bytes of JSON",
                       code="metadata_too_large", param="metadata")


@contextlib.contextmanager
def key_share(state: State, request: Request, model: str, choices: int) -> Iterator[None]:
    """Hold `choices` of the caller's share of `model`'s queue (the caller: `caller_id`) while the call runs: 429
    `key_queue_full` past `max_queue_per_key`, so one caller cannot take every slot."""
    caller = caller_id(request)
    held, limit = state.key_choices, state.config.max_queue_per_key
    if held[caller, model] + choices > limit:
        raise ApiError(429, f"this caller has {held[caller, model]} choices admitted on {model!r} and may have at "
                            f"most {limit}; retry later", code="key_queue_full", retry_after=1)
    held[caller, model] += choices
    try:
        yield
    finally:
        held[caller, model] -= choices
        if not held[caller, model]:
            del held[caller, model]
