"""Supervision of an engine whose model runs in another process (vLLM): a watch task notices the process, or the
engine inside it, die; restarts it with exponential backoff and restores what it served; meanwhile requests get a
503 with `Retry-After`; after more than `RestartPolicy.max` failures within `window_s` it gives up (`dead`)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Literal

from rolemrc.serve.errors import ApiError

log = logging.getLogger("rolemrc.serve")

EngineState = Literal["ok", "restarting", "stalled", "dead"]
STATES: tuple[EngineState, ...] = ("ok", "restarting", "stalled", "dead")


@dataclass(frozen=True)
class RestartPolicy:
    max: int = 5              # restarts tried within `window_s`; the failure after them leaves the engine dead
    window_s: float = 300.0
    backoff_s: float = 1.0    # the wait before the first restart, doubled for each further failure in the window
    backoff_max_s: float = 60.0


class Supervisor:
    """Keeps one engine alive. `probe()`: why the engine cannot answer, or None; `restart()`: start it again and
    restore what it served (raises when it cannot); `on_dead(model, reason)`: called once, when it gives up."""

    interval_s = 1.0   # between probes while healthy

    def __init__(self, model: str, policy: RestartPolicy, probe: Callable[[], Awaitable[str | None]],
                 restart: Callable[[], Awaitable[None]], on_dead: Callable[[str, str], None] | None = None) -> None:
        self.model, self.policy, self.probe, self.restart, self.on_dead = model, policy, probe, restart, on_dead
        self.state: EngineState = "ok"
        self.reason: str | None = None
        self.restarts = 0                 # restarts that came up
        self.failures: deque[float] = deque()   # crashes and failed restarts within the window (monotonic times)
        self.start_s = 30.0               # how long the last start took (for Retry-After)
        self.back_at = 0.0                # when the engine should answer again (monotonic)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def watch(self) -> None:
        self._task = asyncio.create_task(self._watch(), name=f"supervise-{self.model}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task

    def admit(self) -> None:
        """Raise the 503 a new request gets unless the engine is ok."""
        if self.state != "ok":
            raise self.unavailable()

    def unavailable(self) -> ApiError:
        if self.state == "dead":
            return ApiError(503, f"the engine of model {self.model!r} is dead ({self.reason}); it failed more than "
                                 f"{self.policy.max} times within {self.policy.window_s:g} s", code="engine_dead")
        retry = max(1, math.ceil(self.back_at - time.monotonic()))
        return ApiError(503, f"the engine of model {self.model!r} is restarting ({self.reason}); retry in {retry} s",
                        code="engine_restarting", retry_after=retry)

    async def failed(self, error: ApiError) -> ApiError:
        """What a request hears when its call to the engine failed: `error`, unless the engine is down (checked now,
        and once more shortly after: a dying engine may fail a stream before its health says so); then the 503
        above, and recovery starts at once."""
        for wait in (0.0, 0.5):
            if self.state != "ok":
                break
            await asyncio.sleep(wait)
            why = await self.probe()
            if why is not None:
                self.down(why)
        return self.unavailable() if self.state != "ok" else error

    def down(self, why: str) -> None:
        """The engine cannot answer (found by a request, or by the watch loop): restart it."""
        if self.state == "ok":
            self.state, self.reason = "restarting", why
            self.back_at = time.monotonic() + self.policy.backoff_s + self.start_s
            self._wake.set()

    async def _watch(self) -> None:
        while self.state != "dead":
            with suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()
            if self.state == "ok" and (why := await self.probe()) is not None:
                self.down(why)
            if self.state == "restarting":
                await self._recover()

    async def _recover(self) -> None:
        """Restart until it comes up, or the failures in the window exceed the policy's `max` (then dead)."""
        while True:
            now = time.monotonic()
            self.failures.append(now)
            while self.failures[0] < now - self.policy.window_s:
                self.failures.popleft()
            if len(self.failures) > self.policy.max:
                self.state = "dead"
                log.error("engine dead", extra={"model": self.model, "reason": self.reason,
                                                "failures": len(self.failures)})
                if self.on_dead is not None:
                    self.on_dead(self.model, self.reason or "")
                return
            delay = min(self.policy.backoff_s * 2 ** (len(self.failures) - 1), self.policy.backoff_max_s)
            self.back_at = now + delay + self.start_s
            log.warning("engine down, restarting", extra={"model": self.model, "reason": self.reason,
                                                          "attempt": len(self.failures), "delay_s": delay})
            await asyncio.sleep(delay)
            began = time.monotonic()
            try:
                await self.restart()
            except Exception as exc:   # any start failure is one more failure in the window
                self.reason = f"restart failed: {exc}"
                continue
            self.start_s = time.monotonic() - began
            self.restarts += 1
            self.state, self.reason = "ok", None
            log.info("engine restarted", extra={"model": self.model, "start_s": round(self.start_s, 1),
                                                "restarts": self.restarts})
            return
