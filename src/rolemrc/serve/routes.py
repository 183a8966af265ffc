"""The HTTP routes as module-level routers whose handlers reach the server through `request.app.state`
(vLLM's pattern): `v1`, the OpenAI-compatible API and A/B experiments behind the API key, and `ops`,
health and Prometheus metrics."""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from rolemrc.serve import protocol as p
from rolemrc.serve.completions import chat_completion, text_completion
from rolemrc.serve.errors import ApiError
from rolemrc.serve.state import app_state

ERRORS = {status: {"model": p.ErrorResponse, "description": text} for status, text in (
    (400, "bad request"), (401, "missing or wrong API key"), (404, "unknown model, restraint or experiment"),
    (413, "body too large"), (422, "invalid inline restraint or invalid request fields"), (429, "queue full"),
    (503, "shutting down"), (504, "request timeout"))}
STREAMED = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream"}}
bearer = HTTPBearer(auto_error=False, description="an API key from the server's key file or env var")


async def authorized(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
    keys = app_state(request).keys
    if not keys:
        return
    if creds is None or creds.scheme.lower() != "bearer":
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
    if not any(hmac.compare_digest(creds.credentials.encode(), k.encode()) for k in keys):
        raise ApiError(401, "incorrect API key", code="invalid_api_key")


v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)], responses=ERRORS)
ops = APIRouter()


@v1.post("/chat/completions", response_model=p.ChatCompletionResponse, responses=STREAMED)
async def chat(body: p.ChatCompletionRequest, request: Request) -> Any:
    return await chat_completion(request, body)


@v1.post("/completions", response_model=p.CompletionResponse, responses=STREAMED)
async def completions(body: p.CompletionRequest, request: Request) -> Any:
    return await text_completion(request, body)


@v1.get("/models", response_model=p.ModelList)
async def models(request: Request) -> p.ModelList:
    return p.ModelList(data=app_state(request).catalog.cards())


def restraint_card(state: Any, name: str) -> p.RestraintCard:
    r = state.catalog.restraints[name]
    return p.RestraintCard(name=name, hook=r.hook, factor=r.factor, units=r.num_units,
                           models=state.catalog.fitted(name), spec=r.to_dict())


@v1.get("/restraints", response_model=p.RestraintList)
async def restraints(request: Request) -> p.RestraintList:
    state = app_state(request)
    return p.RestraintList(data=[restraint_card(state, name) for name in state.catalog.restraints])


@v1.post("/restraints", response_model=p.RestraintCard, status_code=201,
         responses={200: {"model": p.RestraintCard, "description": "already registered with the same units"},
                    409: {"model": p.ErrorResponse, "description": "the name holds another restraint"}})
async def register_restraint(body: p.RestraintCreate, request: Request) -> Any:
    """Register a restraint while serving (allowed where clients may send specs: allow_inline_restraints); it is
    kept in the database, if any, and registered again when the server restarts."""
    state = app_state(request)
    restraint = state.catalog.parse_spec({**body.spec, "name": body.name}, "spec")
    await state.fetch_restraints(body.name)   # a name another replica registered holds its restraint here too
    new, _ = await state.catalog.register(body.name, restraint)
    if new and state.store is not None:
        await asyncio.to_thread(state.store.add_restraint, body.name, restraint.to_dict(), time.time())
    card = restraint_card(state, body.name)
    return card if new else JSONResponse(card.model_dump(), status_code=200)


@v1.post("/experiments", response_model=p.Experiment, status_code=201,
         responses={409: {"model": p.ErrorResponse, "description": "id taken"}})
async def create_experiment(body: p.ExperimentCreate, request: Request) -> p.Experiment:
    state = app_state(request)
    if state.store is None:
        raise ApiError(400, "experiments need a database ('db' in the serve config)", code="no_database")
    for arm in body.arms:   # every arm must be servable now
        await state.fetch_restraints(arm.model.partition("+")[2], arm.restraint)
        engine, named = state.catalog.lookup(arm.model)
        state.catalog.resolve(engine, named, arm.restraint)
    exp_id = body.id or f"exp-{uuid.uuid4().hex[:12]}"
    arms = [a.model_dump() for a in body.arms]
    created = time.time()
    if not await asyncio.to_thread(state.store.add_experiment, exp_id, body.description, arms, created):
        raise ApiError(409, f"experiment {exp_id!r} exists", code="experiment_exists", param="id")
    return p.Experiment(id=exp_id, description=body.description, arms=body.arms, created=created)


@v1.get("/experiments/{exp_id}", response_model=p.Experiment)
async def get_experiment(exp_id: str, request: Request) -> p.Experiment:
    state = app_state(request)
    exp = await state.experiment(exp_id)
    return p.Experiment(**exp, requests=await asyncio.to_thread(state.store.arm_counts, exp_id))


@ops.get("/health")
async def health(request: Request) -> JSONResponse:
    """`ok`; `restarting` while an engine comes back; `engine_dead` once one has given up (the worst state wins,
    with the engines not ok listed). 503 while draining, when no model can answer, or `degraded` when the A/B log
    cannot take a write (`database`: db_full, db_locked or db_unavailable), else 200."""
    state = app_state(request)
    if state.draining:
        return JSONResponse({"status": "draining", "inflight": state.inflight}, status_code=503)
    engines = {name: engine.health() if hasattr(engine, "health") else ("ok", None)
               for name, engine in state.catalog.engines.items()}
    down = {name: {"state": s, "reason": why} for name, (s, why) in engines.items() if s != "ok"}
    status = "engine_dead" if any(e["state"] == "dead" for e in down.values()) else "restarting" if down else "ok"
    body = {"status": status, "models": sorted(state.catalog.variants)} | ({"engines": down} if down else {})
    database = await asyncio.to_thread(state.store.health) if state.store is not None else None
    if database is not None:
        body |= {"status": "degraded" if status == "ok" else status, "database": database}
    return JSONResponse(body, status_code=503 if len(down) == len(engines) or database else 200)


@ops.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    state = app_state(request)
    state.metrics.inflight.set(state.inflight)
    data, content_type = state.metrics.render(state.catalog.engines)
    return Response(data, media_type=content_type)
