"""Running the app under uvicorn with a bounded graceful shutdown: the first SIGTERM/SIGINT turns API calls away with
503 while in-flight requests finish; those still running when the grace period is nearly over (`shutdown_grace_s`
less a reserve for stopping the engines) are ended (503, or an SSE error event) and logged with finish_reason
`shutdown`; then the engines stop (vLLM: SIGTERM, then SIGKILL of its process group). A second signal ends the
in-flight requests at once; the engines still stop. A config that cannot serve (missing model, missing vLLM, an
engine that does not start) is a ServeConfigError before the port is bound; an engine that dies for good with
`on_engine_dead: exit` shuts the server down and exits with EXIT_ENGINE_DEAD."""

from __future__ import annotations

import logging
import logging.config
import socket
import sys
import time
from typing import Any

import uvicorn

from rolemrc.serve.app import create_app
from rolemrc.serve.config import Role, ServeConfig
from rolemrc.serve.errors import ServeConfigError
from rolemrc.serve.logs import log_config

log = logging.getLogger("rolemrc.serve")
EXIT_ENGINE_DEAD = 1
ENDED_WAIT_S = 1.0   # after ending the in-flight requests: how long their answers and A/B rows may take


def engine_reserve_s(grace_s: float) -> float:
    """The part of the grace period kept for stopping the engines."""
    return min(5.0, grace_s / 4)


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: Any, grace_s: float) -> None:
        super().__init__(config)
        self.state, self.grace_s = state, grace_s
        self.cut_at: float | None = None     # when in-flight requests are ended (monotonic)
        self.ended_at: float | None = None   # when they were

    def begin_shutdown(self) -> None:
        self.state.draining = True
        self.cut_at = time.monotonic() + self.grace_s - engine_reserve_s(self.grace_s)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.started and self.state.stop_requested is not None:   # still starting: nothing to drain
            log.info("stopping while starting", extra={"signal": int(sig)})
            self.should_exit = True
            self.state.loop.call_soon_threadsafe(self.state.stop_requested.set)
        elif self.cut_at is None:
            self.begin_shutdown()
            log.info("draining", extra={"signal": int(sig), "inflight": self.state.inflight})
        else:  # a second signal: end the in-flight requests now (the engines still stop, vLLM included)
            log.info("stopping now", extra={"signal": int(sig), "inflight": self.state.inflight})
            self.cut_at = min(self.cut_at, time.monotonic())

    async def on_tick(self, counter: int) -> bool:
        if self.state.fatal and self.cut_at is None:
            log.error("exiting", extra={"reason": self.state.fatal, "inflight": self.state.inflight})
            self.begin_shutdown()
        if self.cut_at is not None:
            now = time.monotonic()
            if self.state.inflight == 0 or (self.ended_at is not None and now > self.ended_at + ENDED_WAIT_S):
                log.info("drained", extra={"inflight": self.state.inflight})
                return True
            if self.ended_at is None and now >= self.cut_at:
                log.warning("ending in-flight requests", extra={"requests": len(self.state.calls)})
                for call in list(self.state.calls):
                    call.shut_down()
                self.ended_at = now
        return await super().on_tick(counter)


def serve(config: ServeConfig, keys: dict[str, Role], host: str, port: int | None = None,
          socket_fd: int | None = None) -> None:
    """Blocking: serve `config` (its auth checked for `host`, giving `keys`, and its preflight passed) until
    signalled; on the inherited, already bound socket `socket_fd` if given (listened on, like a port bound here, only
    once the engines are up)."""
    logging.config.dictConfig(log_config(config.log_level))
    if not keys:
        log.warning("serving without API keys: every caller is admin" if config.allow_no_auth else
                    "serving without API keys: admin routes answer 403 (allow_no_auth: true opens them)",
                    extra={"host": host})
    app = create_app(config, keys, host)
    # uvicorn's own wait for connections comes after the drain above: whatever is left by then is cancelled
    uv = uvicorn.Config(app, host=host, port=port if port is not None else config.port,
                        log_config=log_config(config.log_level), access_log=False,
                        timeout_graceful_shutdown=ENDED_WAIT_S)
    state = app.state.rolemrc
    try:
        GracefulServer(uv, state, config.shutdown_grace_s).run(
            sockets=None if socket_fd is None else [socket.socket(fileno=socket_fd)])
    except SystemExit:   # uvicorn's exit when the app did not start
        if state.startup_error:
            raise ServeConfigError(state.startup_error) from None
        raise
    if state.fatal:
        print(f"error: {state.fatal}", file=sys.stderr)
        raise SystemExit(EXIT_ENGINE_DEAD)
