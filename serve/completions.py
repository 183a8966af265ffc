"""The completion flow shared by /v1/chat/completions and /v1/completions: pick model and restraint
(or an experiment's arm), admit, generate with timeout and disconnect handling, log, respond."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from rolemrc.serve import protocol as p
from rolemrc.serve.engine import Generation, Prompt, Resolved
from rolemrc.serve.errors import ApiError
from rolemrc.serve.experiments import assign
from rolemrc.serve.sampling import SamplingParams


@dataclass
class Route:
    """Where one request goes."""

    model_id: str
    engine: Any
    resolved: Resolved
    experiment: str | None = None
    arm: str | None = None


class Completions:
    def __init__(self, state: Any) -> None:
        self.state = state
        self.config = state.config

    async def route(self, body: p.SamplingFields) -> Route:
        registry = self.state.registry
        if body.experiment is None:
            engine, named = registry.lookup(body.model)
            return Route(body.model, engine, registry.resolve(engine, named, body.restraint))
        if body.restraint is not None:
            raise ApiError(400, "a request in an experiment gets its restraint from the arm; drop 'restraint'",
                           param="restraint")
        exp = await self.state.experiment(body.experiment)
        arm = assign(exp["id"], exp["arms"], body.user)
        engine, named = registry.lookup(arm["model"])
        if named is None and arm.get("restraint"):
            resolved = registry.resolve(engine, None, arm["restraint"])
        else:
            resolved = registry.resolve(engine, named, None)
        model_id = arm["model"] if named or not arm.get("restraint") else f"{arm['model']}+{arm['restraint']}"
        return Route(model_id, engine, resolved, exp["id"], arm["name"])

    def params(self, body: p.SamplingFields) -> SamplingParams:
        if body.n != 1:
            raise ApiError(400, "only n=1 is supported", param="n")
        max_tokens = body.requested_max_tokens()
        if max_tokens is not None and max_tokens > self.config.max_new_tokens:
            raise ApiError(400, f"max_tokens {max_tokens} is over this server's limit of {self.config.max_new_tokens}",
                           code="max_tokens_too_large", param="max_tokens")
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                              stop=body.stops(), ignore_eos=body.ignore_eos)

    async def handle(self, request: Request, body: p.SamplingFields, prompt: Prompt, endpoint: str) -> Any:
        started = time.time()
        clock = time.perf_counter()
        route = await self.route(body)
        info = request.state.log
        info.update(model=route.model_id, restraint=route.resolved.label, experiment=route.experiment, arm=route.arm)
        gen = await route.engine.submit(prompt, self.params(body), route.resolved)
        request_id = p.new_id("chatcmpl" if endpoint == "chat" else "cmpl")
        info["id"] = request_id
        ctx = Call(self, request, body, prompt, endpoint, route, gen, request_id, started, clock)
        if body.stream:
            return StreamingResponse(ctx.events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await ctx.whole()


@dataclass
class Call:
    """One admitted request on its way out."""

    flow: Completions
    request: Request
    body: p.SamplingFields
    prompt: Prompt
    endpoint: str
    route: Route
    gen: Generation
    id: str
    started: float
    clock: float

    @property
    def deadline(self) -> float:
        return self.clock + self.flow.config.request_timeout_s

    def served(self) -> dict[str, Any]:
        return {"restraint": self.route.resolved.label if self.route.resolved.restraint is not None
                or self.route.resolved.raw is not None else None,
                "experiment": self.route.experiment, "arm": self.route.arm}

    async def whole(self) -> JSONResponse:
        """Non-streaming: wait for the text, unless the client leaves or the timeout passes."""
        async with self.gen:
            text_task = asyncio.create_task(self.gen.text())
            gone = asyncio.create_task(_disconnected(self.request))
            try:
                done, _ = await asyncio.wait({text_task, gone}, timeout=max(0.0, self.deadline - time.perf_counter()),
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
            if text_task not in done:
                text_task.cancel()
                self.gen.cancel()
                if gone in done:
                    return JSONResponse({"error": {"message": "client disconnected", "type": "cancelled",
                                                   "param": None, "code": None}}, status_code=499)
                raise self.timeout()
            text = text_task.result()
            final = self.gen.final
            usage = p.Usage(prompt_tokens=final.prompt_tokens, completion_tokens=final.completion_tokens,
                            total_tokens=final.prompt_tokens + final.completion_tokens)
            await self.record(text, final.finish_reason, usage)
        if self.endpoint == "chat":
            out = p.ChatCompletionResponse(
                id=self.id, model=self.route.model_id, usage=usage, **self.served(),
                choices=[p.ChatChoice(message=p.AssistantMessage(content=text), finish_reason=final.finish_reason)])
        else:
            out = p.CompletionResponse(id=self.id, model=self.route.model_id, usage=usage, **self.served(),
                                       choices=[p.CompletionChoice(text=text, finish_reason=final.finish_reason)])
        return JSONResponse(out.model_dump())

    async def events(self) -> AsyncIterator[str]:
        """Server-sent events: deltas as they are produced, the finish chunk, usage if asked, [DONE].
        A client that disconnects cancels the generation (Starlette cancels this iterator)."""
        created = int(self.started)
        pieces: list[str] = []
        async with self.gen:
            if self.endpoint == "chat":
                yield self.chunk(created, p.Delta(role="assistant", content=""))
            stream = self.gen.__aiter__()
            while True:
                try:
                    delta = await asyncio.wait_for(stream.__anext__(), max(0.0, self.deadline - time.perf_counter()))
                except StopAsyncIteration:
                    break
                except (TimeoutError, asyncio.TimeoutError):
                    self.gen.cancel()
                    yield _sse(self.timeout().body())
                    return
                except ApiError as exc:
                    yield _sse(exc.body())
                    return
                pieces.append(delta)
                yield self.chunk(created, p.Delta(content=delta) if self.endpoint == "chat" else delta)
            final = self.gen.final
            usage = p.Usage(prompt_tokens=final.prompt_tokens, completion_tokens=final.completion_tokens,
                            total_tokens=final.prompt_tokens + final.completion_tokens)
            await self.record("".join(pieces), final.finish_reason, usage)
        yield self.chunk(created, p.Delta() if self.endpoint == "chat" else "", finish=final.finish_reason)
        if self.body.stream_options is not None and self.body.stream_options.include_usage:
            yield self.chunk(created, None, usage=usage)
        yield "data: [DONE]\n\n"

    def chunk(self, created: int, delta: Any, *, finish: str | None = None, usage: p.Usage | None = None) -> str:
        if self.endpoint == "chat":
            choices = [] if delta is None else [p.ChunkChoice(delta=delta, finish_reason=finish)]
            out = p.ChatCompletionChunk(id=self.id, created=created, model=self.route.model_id, choices=choices,
                                        usage=usage, **self.served())
        else:
            choices = [] if delta is None else [p.CompletionChoice(text=delta, finish_reason=finish)]
            out = p.CompletionResponse(id=self.id, created=created, model=self.route.model_id, choices=choices,
                                       usage=usage, **self.served())
        return _sse(out.model_dump(exclude_none=True))

    def timeout(self) -> ApiError:
        return ApiError(504, f"the request took longer than {self.flow.config.request_timeout_s} s",
                        code="timeout")

    async def record(self, text: str, finish_reason: str, usage: p.Usage) -> None:
        """Metrics, and for experiment requests the A/B row, written before anything is acknowledged."""
        latency = time.perf_counter() - self.clock
        state = self.flow.state
        self.request.state.log.update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                                      finish_reason=finish_reason)
        state.metrics.observe(self.route.engine.name, self.route.resolved.label, self.endpoint, 200, latency,
                              usage.prompt_tokens, usage.completion_tokens)
        if self.route.experiment is None:
            return
        messages = self.prompt.messages if self.prompt.messages is not None else [{"role": "prompt",
                                                                                  "content": self.prompt.text}]
        row = {"id": self.id, "experiment": self.route.experiment, "arm": self.route.arm, "user": self.body.user,
               "model": self.route.model_id, "restraint": self.served()["restraint"], "endpoint": self.endpoint,
               "messages": messages, "response": text, "finish_reason": finish_reason, "latency_s": latency,
               "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
               "metadata": self.body.metadata, "started": self.started, "finished": time.time()}
        await asyncio.to_thread(state.store.log_request, row)


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message is that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
