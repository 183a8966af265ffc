"""Running the app under uvicorn with a graceful drain: the first SIGTERM/SIGINT turns API calls
away with 503 while in-flight requests finish (up to drain_timeout_s), then the server stops. A config that cannot
serve (missing model, missing vLLM, an engine that does not start) is a ServeConfigError before the port is bound; an
engine that dies for good with `on_engine_dead: exit` drains the server and exits with EXIT_ENGINE_DEAD."""

from __future__ import annotations

import logging
import logging.config
import sys
import time
from typing import Any

import uvicorn

from rolemrc.serve.app import create_app
from rolemrc.serve.config import ServeConfig
from rolemrc.serve.errors import ServeConfigError
from rolemrc.serve.logs import log_config

log = logging.getLogger("rolemrc.serve")
EXIT_ENGINE_DEAD = 1


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: Any, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state, self.drain_timeout_s = state, drain_timeout_s
        self.drain_deadline: float | None = None

    def drain(self) -> None:
        self.state.draining = True
        self.drain_deadline = time.monotonic() + self.drain_timeout_s

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.started and self.state.stop_requested is not None:   # still starting: nothing to drain
            log.info("stopping while starting", extra={"signal": int(sig)})
            self.should_exit = True
            self.state.loop.call_soon_threadsafe(self.state.stop_requested.set)
        elif self.drain_deadline is None:
            self.drain()
            log.info("draining", extra={"signal": int(sig), "inflight": self.state.inflight})
        else:  # a second signal: stop now
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.state.fatal and self.drain_deadline is None:
            log.error("exiting", extra={"reason": self.state.fatal, "inflight": self.state.inflight})
            self.drain()
        if self.drain_deadline is not None and (self.state.inflight == 0 or time.monotonic() > self.drain_deadline):
            log.info("drained", extra={"inflight": self.state.inflight})
            return True
        return await super().on_tick(counter)


def serve(config: ServeConfig, host: str | None = None, port: int | None = None) -> None:
    """Blocking: serve until signalled."""
    host = host or config.host
    keys = config.check_auth(host)
    config.preflight()
    logging.config.dictConfig(log_config(config.log_level))
    if not keys:
        log.warning("serving without API keys: every caller is admin", extra={"host": host})
    app = create_app(config, keys)
    uv = uvicorn.Config(app, host=host, port=port if port is not None else config.port,
                        log_config=log_config(config.log_level), access_log=False,
                        timeout_graceful_shutdown=int(config.drain_timeout_s) + 1)
    state = app.state.rolemrc
    try:
        DrainingServer(uv, state, config.drain_timeout_s).run()
    except SystemExit:   # uvicorn's exit when the app did not start
        if state.startup_error:
            raise ServeConfigError(state.startup_error) from None
        raise
    if state.fatal:
        print(f"error: {state.fatal}", file=sys.stderr)
        raise SystemExit(EXIT_ENGINE_DEAD)
