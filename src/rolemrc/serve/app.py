"""`create_app(config)`: the OpenAI-compatible FastAPI app with restraints, A/B experiments, health
and Prometheus metrics. Every error is answered in OpenAI's shape."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager, suppress

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rolemrc.serve.catalog import ModelCatalog
from rolemrc.serve.config import Role, ServeConfig
from rolemrc.serve.errors import ApiError, database_refused
from rolemrc.serve.middleware import BodyLimit, HostCheck, Lifecycle
from rolemrc.serve.routes import ops, v1
from rolemrc.serve.state import State, app_state
from rolemrc.serve.store import Store, StoreError

log = logging.getLogger("rolemrc.serve")


@asynccontextmanager
async def lifespan(app: FastAPI):
    """Load the engines and open the A/B database; stop and close them on shutdown."""
    state: State = app.state.rolemrc
    try:
        state.store = Store.open(state.config.db) if state.config.db else None   # before any model loads
        state.catalog = ModelCatalog(state.config)
        for engine in state.catalog.engines.values():
            if hasattr(engine, "on_dead"):
                engine.on_dead = state.engine_dead
        started = await start_unless_stopped(state)
    except Exception as exc:   # reported by `serve` as one error line once uvicorn gives up
        state.startup_error = str(exc)
        raise
    if not started:
        if state.store is not None:
            state.store.close()
        log.info("stopped while starting")
        yield
        return
    if state.store is not None:
        await state.restore_restraints()
    log.info("ready", extra={"models": sorted(state.catalog.variants)})
    try:
        yield
    finally:
        await state.catalog.stop()
        if state.store is not None:
            state.store.close()
        log.info("stopped")


async def start_unless_stopped(state: State) -> bool:
    """Start the engines, unless a signal asks the server to stop first (a vLLM start takes minutes): then stop
    whatever had started and return False."""
    state.stop_requested = asyncio.Event()
    state.loop = asyncio.get_running_loop()
    start = asyncio.create_task(state.catalog.start())
    stop = asyncio.create_task(state.stop_requested.wait())
    await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if start.done():
        if start.exception() is not None:
            await state.catalog.stop()
        start.result()
        return True
    start.cancel()
    with suppress(asyncio.CancelledError):
        await start
    await state.catalog.stop()
    return False


def create_app(config: ServeConfig, keys: dict[str, Role] | None = None, host: str | None = None) -> FastAPI:
    """`keys`: the API keys and their roles (default: the config's); `host`: the address served (default: the
    config's), which decides the Host names accepted unless the config lists them."""
    state = State(config, config.api_keys() if keys is None else keys)
    app = FastAPI(title="rolemrc serve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible endpoint for RoleMRC models with per-request restraints and A/B logs")
    app.state.rolemrc = state
    app.include_router(v1)
    app.include_router(ops)
    install_error_handlers(app)
    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_origins, allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type", "Idempotency-Key"],
                           expose_headers=["Idempotent-Replayed", "Retry-After"])
    if (names := config.host_names(host or config.host)) is not None:
        app.add_middleware(HostCheck, names=names)
    app.add_middleware(Lifecycle, state=state)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    return app


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StoreError, store_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, crashed)


def count(request: Request, status: int) -> None:
    """Failed completion requests count too (model 'unknown' when routing failed)."""
    if request.url.path.endswith("completions"):
        info = getattr(request.state, "log", {})
        endpoint = "chat" if request.url.path.endswith("chat/completions") else "completion"
        app_state(request).metrics.requests.labels(info.get("model", "unknown").split("+")[0],
                                                   info.get("restraint", "none"), endpoint, str(status)).inc()


async def api_error(request: Request, exc: ApiError) -> JSONResponse:
    count(request, exc.status)
    return exc.response()


async def store_error(request: Request, exc: StoreError) -> JSONResponse:
    """The database could not take a write or answer: 503 with its code (never a 200 without the row)."""
    log.error("database error: %s", exc)
    return await api_error(request, database_refused(exc))


async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    count(request, 400 if errors and errors[0].get("type") == "json_invalid" else 422)
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip()).response()
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    message = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
                        for e in errors[:5])
    return ApiError(422, message, code="invalid_request", param=".".join(loc) or None).response()


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return ApiError(exc.status_code, str(exc.detail), code=None).response()


async def crashed(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error")
    count(request, 500)
    return ApiError(500, f"internal error: {type(exc).__name__}").response()
