"""The HTTP routes as module-level routers whose handlers reach the server through `request.app.state`
(vLLM's pattern): `v1`, the OpenAI-compatible API and A/B experiments behind the API key (changing restraints and
experiments behind an admin key), and `ops`, health and Prometheus metrics."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from rolemrc.serve import protocol as p
from rolemrc.serve.completions import chat_completion, text_completion
from rolemrc.serve.config import Role
from rolemrc.serve.errors import ApiError
from rolemrc.serve.state import app_state

ERRORS = {status: {"model": p.ErrorResponse, "description": text} for status, text in (
    (400, "bad request or a Host not allowed"), (401, "missing or wrong API key"),
    (403, "an admin route with a serve key, or on a server without keys unless allow_no_auth"),
    (404, "unknown model, restraint or experiment"),
    (413, "body too large"), (422, "invalid inline restraint or invalid request fields"), (429, "queue full"),
    (503, "shutting down"), (504, "request timeout"))}
STREAMED = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream"}}
bearer = HTTPBearer(auto_error=False, description="an API key from the server's key file or env var")


def caller(state: Any, creds: HTTPAuthorizationCredentials | None) -> tuple[str | None, Role]:
    """(a short stable id of the caller's key, its role); 401 without a valid key. Without keys (auth off) every
    caller is admin with `allow_no_auth: true`, else serve."""
    if not state.keys:
        return None, "admin" if state.config.allow_no_auth else "serve"
    if creds is None or creds.scheme.lower() != "bearer":
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
    sent = creds.credentials.encode()
    roles = [role for key, role in state.keys.items() if hmac.compare_digest(sent, key.encode())]
    if not roles:
        raise ApiError(401, "incorrect API key", code="invalid_api_key")
    return hashlib.sha256(sent).hexdigest()[:12], roles[0]


async def authorized(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
    """Sets `request.state.key` and `request.state.role` for every /v1 route."""
    request.state.key, request.state.role = caller(app_state(request), creds)


async def admin(request: Request) -> None:
    """403 for a key whose role is not admin (after `authorized`), and for every caller of a server without keys
    unless its config says `allow_no_auth: true`."""
    if request.state.role != "admin":
        if not app_state(request).keys:
            raise ApiError(403, "admin routes need an admin key, and this server has none: set api_key_file or "
                                "api_key_env in its config, or allow_no_auth: true to open them to every caller",
                           code="admin_needs_keys")
        raise ApiError(403, "this route needs an admin key", code="forbidden")


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
    state = app_state(request)
    await state.sync_restraints()   # no variant of one another replica deleted (within RESTRAINTS_STALE_S)
    return p.ModelList(data=state.catalog.cards())


def restraint_card(state: Any, name: str) -> p.RestraintCard:
    r = state.catalog.restraints[name]
    return p.RestraintCard(name=name, hook=r.hook, factor=r.factor, units=r.num_units,
                           models=state.catalog.fitted(name), spec=r.to_dict())


@v1.get("/restraints", response_model=p.RestraintList)
async def restraints(request: Request) -> p.RestraintList:
    state = app_state(request)
    await state.sync_restraints()   # none that another replica deleted or replaced (within RESTRAINTS_STALE_S)
    return p.RestraintList(data=[restraint_card(state, name) for name in state.catalog.restraints])


@v1.post("/restraints", response_model=p.RestraintCard, status_code=201, dependencies=[Depends(admin)],
         responses={200: {"model": p.RestraintCard, "description": "already registered with the same units"},
                    409: {"model": p.ErrorResponse, "description": "the name holds another restraint"}})
async def register_restraint(body: p.RestraintCreate, request: Request) -> Any:
    """Register a restraint while serving (allowed where clients may send specs: allow_inline_restraints); it is
    kept in the database, if any, registered again when the server restarts and served by every replica. A name holds
    one spec until it is deleted: the same spec again is a 200, another a 409 (the database decides between
    replicas)."""
    state = app_state(request)
    restraint = state.catalog.parse_spec({**body.spec, "name": body.name}, "spec", inline=False)
    new = await state.register_restraint(body.name, restraint)
    card = restraint_card(state, body.name)
    return card if new else JSONResponse(card.model_dump(), status_code=200)


@v1.post("/experiments", response_model=p.Experiment, status_code=201, dependencies=[Depends(admin)],
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
    if not await asyncio.to_thread(state.store.add_experiment, exp_id, body.description, arms, created,
                                   reveal_arm=body.reveal_arm):
        raise ApiError(409, f"experiment {exp_id!r} exists", code="experiment_exists", param="id")
    return p.Experiment(id=exp_id, description=body.description, arms=body.arms, created=created,
                        reveal_arm=body.reveal_arm)


@v1.get("/experiments/{exp_id}", response_model=p.Experiment, dependencies=[Depends(admin)])
async def get_experiment(exp_id: str, request: Request) -> p.Experiment:
    state = app_state(request)
    exp = await state.experiment(exp_id)
    return p.Experiment(**exp, requests=await asyncio.to_thread(state.store.arm_counts, exp_id))


@v1.delete("/restraints/{name}", status_code=204, dependencies=[Depends(admin)],
           responses={409: {"model": p.ErrorResponse, "description": "from the config file, or an experiment uses it"}})
async def delete_restraint(name: str, request: Request) -> Response:
    """Unregister a restraint registered while serving: its variants go, and its name is free again (on every
    replica: the others stop serving it within RESTRAINTS_STALE_S)."""
    state = app_state(request)
    unknown = ApiError(404, f"unknown restraint {name!r}", code="restraint_not_found", param="name")
    if state.store is None and name not in state.catalog.restraints:
        raise unknown
    if name in state.config.restraints:
        raise ApiError(409, f"restraint {name!r} comes from the config file; remove it there", code="restraint_in_config",
                       param="name")
    if state.store is None:
        await state.catalog.unregister(name)
        return Response(status_code=204)
    if users := await asyncio.to_thread(state.store.experiments_using, name):
        raise ApiError(409, f"restraint {name!r} is an arm of experiment(s) {users}; delete those first",
                       code="restraint_in_use", param="name")
    if not await state.delete_restraint(name):   # the store's, whichever replica registered it
        raise unknown
    return Response(status_code=204)


@v1.delete("/experiments/{exp_id}", status_code=204, dependencies=[Depends(admin)])
async def delete_experiment(exp_id: str, request: Request) -> Response:
    """Delete an experiment with its logged requests; its id is free again."""
    state = app_state(request)
    await state.experiment(exp_id)   # 400 without a database, 404 unknown
    await asyncio.to_thread(state.store.delete_experiment, exp_id)
    return Response(status_code=204)


@ops.get("/health")
async def health(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> JSONResponse:
    """`ok`; `restarting` while an engine comes back; `engine_dead` once one has given up (the worst state wins,
    with the engines not ok listed; `engine_stalled` when an engine's step has run past its bound). 503 while draining, when
    no model can answer, or `degraded` when the A/B log cannot take a write (`database`: db_full, db_locked or
    db_unavailable), else 200. Only the status without an admin key (unless public_health_details)."""
    state = app_state(request)
    if state.draining:
        body, code = {"status": "draining", "inflight": state.inflight}, 503
    else:
        engines = {name: engine.health() if hasattr(engine, "health") else ("ok", None)
                   for name, engine in state.catalog.engines.items()}
        down = {name: {"state": s, "reason": why} for name, (s, why) in engines.items() if s != "ok"}
        states = {e["state"] for e in down.values()}
        status = ("engine_dead" if "dead" in states else "engine_stalled" if "stalled" in states
                  else "restarting" if down else "ok")
        body = {"status": status, "models": sorted(state.catalog.variants)} | ({"engines": down} if down else {})
        database = await asyncio.to_thread(state.store.health) if state.store is not None else None
        if database is not None:
            body |= {"status": "degraded" if status == "ok" else status, "database": database}
        code = 503 if len(down) == len(engines) or database else 200
    if not (state.config.public_health_details or is_admin(state, creds)):
        body = {"status": body["status"]}
    return JSONResponse(body, status_code=code)


def is_admin(state: Any, creds: HTTPAuthorizationCredentials | None) -> bool:
    try:
        return caller(state, creds)[1] == "admin"
    except ApiError:
        return False


@ops.get("/metrics", response_class=Response)
async def metrics(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Response:
    """Prometheus metrics; needs a key of any role unless public_metrics."""
    state = app_state(request)
    if not state.config.public_metrics:
        caller(state, creds)
    state.metrics.inflight.set(state.inflight)
    data, content_type = state.metrics.render(state.catalog.engines)
    return Response(data, media_type=content_type)
