"""What the routes share, kept on `app.state.rolemrc`; `draining` and `inflight` are read by the server's drain
loop and the lifecycle middleware."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from rolemrc.serve.config import ServeConfig
from rolemrc.serve.errors import ApiError
from rolemrc.serve.metrics import Metrics
from rolemrc.serve.registry import Registry
from rolemrc.serve.store import Store


@dataclass
class State:
    config: ServeConfig
    keys: set[str]
    metrics: Metrics = field(default_factory=Metrics)
    registry: Registry | None = None
    store: Store | None = None
    draining: bool = False
    inflight: int = 0
    stop_requested: asyncio.Event | None = None   # set by a signal that arrives while the engines start
    loop: asyncio.AbstractEventLoop | None = None

    async def experiment(self, exp_id: str) -> dict[str, Any]:
        if self.store is None:
            raise ApiError(400, "experiments need a database ('db' in the serve config)", code="no_database")
        exp = await asyncio.to_thread(self.store.experiment, exp_id)
        if exp is None:
            raise ApiError(404, f"no experiment {exp_id!r}", code="experiment_not_found", param="experiment")
        return exp


def app_state(request: Request) -> State:
    """The State of the app serving `request`."""
    return request.app.state.rolemrc
