"""What the routes share, kept on `app.state.rolemrc`; `draining`, `inflight` and `calls` are read by the server's
shutdown and the lifecycle middleware."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from rolemrc.intervene.spec import Restraint, RestraintError
from rolemrc.serve.catalog import ModelCatalog
from rolemrc.serve.config import Role, ServeConfig
from rolemrc.serve.errors import ApiError
from rolemrc.serve.metrics import Metrics
from rolemrc.serve.store import Store

log = logging.getLogger("rolemrc.serve")


@dataclass
class State:
    config: ServeConfig
    keys: dict[str, Role]   # API key -> role; empty: auth off
    metrics: Metrics = field(default_factory=Metrics)
    catalog: ModelCatalog | None = None
    store: Store | None = None
    draining: bool = False
    inflight: int = 0
    calls: set[Any] = field(default_factory=set)   # completions.Call admitted and not yet answered (shut_down at grace)
    stop_requested: asyncio.Event | None = None   # set by a signal that arrives while the engines start
    loop: asyncio.AbstractEventLoop | None = None
    fatal: str | None = None   # why the server must exit non-zero (an engine dead, with on_engine_dead: exit)
    startup_error: str | None = None   # why the engines did not start
    key_choices: Counter[tuple[str, str]] = field(default_factory=Counter)   # (caller, model) -> choices admitted

    def engine_dead(self, model: str, reason: str) -> None:
        """A supervised engine gave up: with on_engine_dead `exit` the server drains and exits non-zero; with
        `serve_others` the other models go on (requests for this one get 503 engine_dead)."""
        if self.config.on_engine_dead == "exit":
            self.fatal = f"the engine of model {model!r} is dead: {reason}"

    async def fetch_restraints(self, *names: Any) -> None:
        """Register the named restraints that another replica registered (kept in the shared store) and this one
        has not seen yet; names this server knows, None and inline specs are skipped."""
        if self.store is None:
            return
        for name in {n for n in names if isinstance(n, str) and n and n not in self.catalog.restraints}:
            spec = await asyncio.to_thread(self.store.restraint, name)
            if spec is None:
                continue
            try:
                await self.catalog.register(name, Restraint.from_dict(spec))
            except RestraintError as exc:
                log.warning("restraint %r in the database is not served: %s", name, exc)

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
