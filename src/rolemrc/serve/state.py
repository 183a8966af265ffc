"""What the routes share, kept on `app.state.rolemrc`; `draining`, `inflight` and `calls` are read by the server's
shutdown and the lifecycle middleware."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from rolemrc.intervene.spec import Restraint, RestraintError
from rolemrc.serve.catalog import ModelCatalog, restraint_exists
from rolemrc.serve.config import Role, ServeConfig
from rolemrc.serve.errors import ApiError
from rolemrc.serve.metrics import Metrics
from rolemrc.serve.store import Store, StoreError

log = logging.getLogger("rolemrc.serve")
# the bounded staleness of registered restraints across replicas: a use of a registered (non-config) name checks the
# store's restraints_generation unless this replica checked it less than this long ago, so a restraint deleted or
# replaced on another replica is not served here after this long (a new name is looked up at once)
RESTRAINTS_STALE_S = 0.5


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
    # the registered (non-config) restraints this replica serves, by name: the store's version of each
    restraint_versions: dict[str, int] = field(default_factory=dict)
    restraints_generation: int | None = None   # the store's restraints_generation restraint_versions agree with
    restraints_checked: float = float("-inf")  # time.monotonic() when that generation was read (its query began)
    _restraints_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def engine_dead(self, model: str, reason: str) -> None:
        """A supervised engine gave up: with on_engine_dead `exit` the server drains and exits non-zero; with
        `serve_others` the other models go on (requests for this one get 503 engine_dead)."""
        if self.config.on_engine_dead == "exit":
            self.fatal = f"the engine of model {model!r} is dead: {reason}"

    async def fetch_restraints(self, *names: Any) -> None:
        """Before a use of the named restraints: forget those another replica deleted or replaced since (within
        RESTRAINTS_STALE_S, `sync_restraints`) and register those it registered that this one has not seen yet (kept in
        the shared store, looked up at once); config names, None and inline specs are skipped."""
        if self.store is None:
            return
        names = {n for n in names if isinstance(n, str) and n and n not in self.config.restraints}
        if not names:
            return
        await self.sync_restraints()
        if names <= set(self.catalog.restraints):
            return
        async with self._restraints_lock:
            for name in names - set(self.catalog.restraints):
                found = await asyncio.to_thread(self.store.versioned_restraint, name)
                if found is None:
                    continue
                try:
                    await self._load(name, found[0], Restraint.from_dict(found[1]))
                except RestraintError as exc:
                    log.warning("restraint %r in the database is not served: %s", name, exc)

    async def sync_restraints(self) -> None:
        """Unregister the registered restraints another replica deleted or registered again (another version) since:
        one single-row read of the store's restraints_generation at most every RESTRAINTS_STALE_S, and the names'
        versions (no specs) only when it moved. Without a store, nothing."""
        if self.store is None or time.monotonic() - self.restraints_checked < RESTRAINTS_STALE_S:
            return
        async with self._restraints_lock:
            began = time.monotonic()
            if began - self.restraints_checked < RESTRAINTS_STALE_S:   # checked while this one waited
                return
            generation, versions = await asyncio.to_thread(self.store.restraint_versions, self.restraints_generation)
            if versions is not None:
                for name, version in list(self.restraint_versions.items()):
                    if versions.get(name) != version:
                        await self._drop(name)
                self.restraints_generation = generation
            self.restraints_checked = began   # the read saw every change committed before it began

    async def restore_restraints(self) -> None:
        """At start: register the restraints kept in the store. One that no longer fits, or whose name the config
        gives another restraint (the config's wins), is logged and skipped."""
        began = time.monotonic()
        generation, kept = await asyncio.to_thread(self.store.versioned_restraints)
        async with self._restraints_lock:
            for name, (version, spec) in kept.items():
                try:
                    restraint = Restraint.from_dict(spec)
                    if name in self.config.restraints:
                        if self.catalog.restraints[name].digest != restraint.digest:
                            log.warning("restraint %r registered earlier is not served: the config's restraint of "
                                        "that name is", name)
                        continue
                    await self._load(name, version, restraint)
                except (ApiError, RestraintError) as exc:
                    log.warning("restraint %r registered earlier is not served: %s", name, exc)
            self.restraints_generation, self.restraints_checked = generation, began

    async def register_restraint(self, name: str, restraint: Restraint) -> bool:
        """Register a restraint while serving (`POST /v1/restraints`): whether it is new. With a store, the store
        decides, atomically across replicas: the first registration of a name wins (new); another with the same spec
        is not new; one with another spec is 409 `restraint_exists` on every replica, until the name is deleted."""
        if self.store is None or name in self.config.restraints:
            return (await self.catalog.register(name, restraint))[0]
        await self.catalog.check(name, restraint)   # refused here before the store keeps it for every replica
        async with self._restraints_lock:
            new, version, spec = await asyncio.to_thread(self.store.add_restraint, name, restraint.to_dict(),
                                                         time.time())
            held = restraint if new else Restraint.from_dict(spec)
            if held.digest != restraint.digest:
                raise restraint_exists(name)
            try:
                await self._load(name, version, held)
            except Exception:
                if new:   # the row goes too, unless the name was deleted (or replaced) meanwhile
                    with contextlib.suppress(StoreError):
                        await asyncio.to_thread(self.store.delete_restraint, name, version)
                raise
            return new

    async def delete_restraint(self, name: str) -> bool:
        """Delete a registered restraint from the store, and here (other replicas forget it within
        RESTRAINTS_STALE_S); False when the store holds no such name."""
        async with self._restraints_lock:
            deleted = await asyncio.to_thread(self.store.delete_restraint, name)
            if name in self.restraint_versions:
                await self._drop(name)
            return deleted

    async def _load(self, name: str, version: int, restraint: Restraint) -> None:
        """Serve the store's `version` of `name` here (replacing another version), holding _restraints_lock."""
        if self.restraint_versions.get(name) == version:
            return
        if name in self.restraint_versions:
            await self._drop(name)
        await self.catalog.register(name, restraint)
        self.restraint_versions[name] = version

    async def _drop(self, name: str) -> None:
        await self.catalog.unregister(name)
        del self.restraint_versions[name]

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


def caller_id(request: Request) -> str:
    """Who sent `request`, as its A/B rows, its idempotency keys and its share of a queue know it, never in the
    clear: `key:` and the id of the API key it authenticated with (`request.state.key`, the first 12 hex digits of
    the key's sha256), else (a server without keys) `addr:` and the first 12 hex digits of the sha256 of the client's
    address (the clients at one address, loopback ones too, are one caller)."""
    key = getattr(request.state, "key", None)
    if key:
        return f"key:{key}"
    host = request.client.host if request.client else "unknown"
    return f"addr:{hashlib.sha256(host.encode()).hexdigest()[:12]}"
