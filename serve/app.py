"""`create_app(config)`: the OpenAI-compatible FastAPI app with restraints, A/B experiments, health
and Prometheus metrics. Every error is answered in OpenAI's shape."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from rolemrc.serve import protocol as p
from rolemrc.serve.completions import Completions
from rolemrc.serve.config import ServeConfig
from rolemrc.serve.engine import Prompt
from rolemrc.serve.errors import ApiError
from rolemrc.serve.metrics import Metrics
from rolemrc.serve.middleware import BodyLimit, Lifecycle
from rolemrc.serve.registry import Registry
from rolemrc.serve.store import Store

log = logging.getLogger("rolemrc.serve")
ERRORS = {status: {"model": p.ErrorResponse, "description": text} for status, text in (
    (400, "bad request"), (401, "missing or wrong API key"), (404, "unknown model, restraint or experiment"),
    (413, "body too large"), (422, "invalid inline restraint or invalid request fields"), (429, "queue full"),
    (503, "shutting down"), (504, "request timeout"))}


@dataclass
class State:
    """What the routes share; `draining` and `inflight` are read by the server's drain loop."""

    config: ServeConfig
    keys: set[str]
    metrics: Metrics = field(default_factory=Metrics)
    registry: Registry | None = None
    store: Store | None = None
    draining: bool = False
    inflight: int = 0

    async def experiment(self, exp_id: str) -> dict[str, Any]:
        if self.store is None:
            raise ApiError(400, "experiments need a database ('db' in the serve config)", code="no_database")
        exp = await asyncio.to_thread(self.store.experiment, exp_id)
        if exp is None:
            raise ApiError(404, f"no experiment {exp_id!r}", code="experiment_not_found", param="experiment")
        return exp


def create_app(config: ServeConfig) -> FastAPI:
    state = State(config, config.api_keys())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.registry = Registry(config)
        state.store = Store(config.db) if config.db else None
        await state.registry.start()
        log.info("ready", extra={"models": sorted(state.registry.variants)})
        try:
            yield
        finally:
            await state.registry.stop()
            if state.store is not None:
                state.store.close()
            log.info("stopped")

    app = FastAPI(title="rolemrc serve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible endpoint for RoleMRC models with per-request restraints and A/B logs")
    app.state.rolemrc = state
    bearer = HTTPBearer(auto_error=False, description="an API key from the server's key file or env var")

    async def authorized(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if not state.keys:
            return
        if creds is None or creds.scheme.lower() != "bearer":
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
        import hmac

        if not any(hmac.compare_digest(creds.credentials.encode(), k.encode()) for k in state.keys):
            raise ApiError(401, "incorrect API key", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)], responses=ERRORS)
    flow = Completions(state)

    @v1.post("/chat/completions", response_model=p.ChatCompletionResponse,
             responses={200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream"}})
    async def chat(body: p.ChatCompletionRequest, request: Request) -> Any:
        return await flow.handle(request, body, Prompt(messages=[m.turn() for m in body.messages]), "chat")

    @v1.post("/completions", response_model=p.CompletionResponse,
             responses={200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream"}})
    async def completions(body: p.CompletionRequest, request: Request) -> Any:
        if isinstance(body.prompt, list) and len(body.prompt) != 1:
            raise ApiError(400, "send exactly one prompt per request", param="prompt")
        return await flow.handle(request, body, Prompt(text=body.text()), "completion")

    @v1.get("/models", response_model=p.ModelList)
    async def models() -> p.ModelList:
        return p.ModelList(data=state.registry.cards())

    @v1.post("/experiments", response_model=p.Experiment, status_code=201,
             responses={409: {"model": p.ErrorResponse, "description": "id taken"}})
    async def create_experiment(body: p.ExperimentCreate) -> p.Experiment:
        if state.store is None:
            raise ApiError(400, "experiments need a database ('db' in the serve config)", code="no_database")
        for arm in body.arms:   # every arm must be servable now
            engine, named = state.registry.lookup(arm.model)
            state.registry.resolve(engine, named, arm.restraint)
        exp_id = body.id or f"exp-{uuid.uuid4().hex[:12]}"
        arms = [a.model_dump() for a in body.arms]
        created = time.time()
        if not await asyncio.to_thread(state.store.add_experiment, exp_id, body.description, arms, created):
            raise ApiError(409, f"experiment {exp_id!r} exists", code="experiment_exists", param="id")
        return p.Experiment(id=exp_id, description=body.description, arms=body.arms, created=created)

    @v1.get("/experiments/{exp_id}", response_model=p.Experiment)
    async def get_experiment(exp_id: str) -> p.Experiment:
        return p.Experiment(**await state.experiment(exp_id))

    @v1.get("/experiments/{exp_id}/report", responses={200: {"content": {"text/html": {}}}})
    async def experiment_report(exp_id: str, format: str = "json") -> Any:
        from rolemrc.serve.report import build_report, report_html

        if format not in ("json", "html"):
            raise ApiError(400, "format is json or html", param="format")
        await state.experiment(exp_id)
        report = await asyncio.to_thread(build_report, state.store, exp_id)
        return HTMLResponse(report_html(report)) if format == "html" else JSONResponse(report)

    app.include_router(v1)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.draining:
            return JSONResponse({"status": "draining", "inflight": state.inflight}, status_code=503)
        return JSONResponse({"status": "ok", "models": sorted(state.registry.variants)})

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        state.metrics.inflight.set(state.inflight)
        data, content_type = state.metrics.render(state.registry.engines)
        return Response(data, media_type=content_type)

    install_error_handlers(app, state)
    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(Lifecycle, state=state)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    return app


def install_error_handlers(app: FastAPI, state: State) -> None:
    def count(request: Request, status: int) -> None:
        """Failed completion requests count too (model 'unknown' when routing failed)."""
        if request.url.path.endswith("completions"):
            info = getattr(request.state, "log", {})
            endpoint = "chat" if request.url.path.endswith("chat/completions") else "completion"
            state.metrics.requests.labels(info.get("model", "unknown").split("+")[0], info.get("restraint", "none"),
                                          endpoint, str(status)).inc()

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        count(request, exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
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

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail), code=None).response()

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        count(request, 500)
        return ApiError(500, f"internal error: {type(exc).__name__}").response()
