"""Serving /v1/chat/completions and /v1/completions. `Call` is the shared core: route, admit, generate with
timeout and disconnect handling, record, answer whole or as server-sent events. `ChatCall` and `TextCall`
only shape what differs: the response and chunk objects, and how the prompt is logged."""

from __future__ import annotations

import asyncio
import json
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from rolemrc.serve import protocol as p
from rolemrc.serve.engines.base import Generation, Piece, Prompt, TokenLogprob
from rolemrc.serve.errors import ApiError
from rolemrc.serve.routing import Route, route, sampling_params
from rolemrc.serve.state import State, app_state


async def chat_completion(request: Request, body: p.ChatCompletionRequest) -> Response:
    return await ChatCall.serve(request, body, Prompt(messages=[m.turn() for m in body.messages]))


async def text_completion(request: Request, body: p.CompletionRequest) -> Response:
    if isinstance(body.prompt, list) and len(body.prompt) != 1:
        raise ApiError(400, "send exactly one prompt per request", param="prompt")
    return await TextCall.serve(request, body, Prompt(text=body.text()))


@dataclass
class Call(ABC):
    """One admitted request on its way out."""

    endpoint: ClassVar[str]                   # its label in metrics, logs and the A/B table
    id_prefix: ClassVar[str]
    response_model: ClassVar[type[BaseModel]]
    chunk_model: ClassVar[type[BaseModel]]

    state: State
    request: Request
    body: p.SamplingFields
    prompt: Prompt
    route: Route
    gen: Generation | None   # set once admitted
    id: str
    started: float
    clock: float

    @classmethod
    async def serve(cls, request: Request, body: p.SamplingFields, prompt: Prompt) -> Response:
        """Pick model and restraint (or an experiment's arm), admit, and answer whole or streamed."""
        state = app_state(request)
        started, clock = time.time(), time.perf_counter()
        target = await route(state, body)
        info = request.state.log
        info.update(model=target.model_id, restraint=target.resolved.label, experiment=target.experiment,
                    arm=target.arm)
        call = cls(state, request, body, prompt, target, None, p.new_id(cls.id_prefix), started, clock)
        info["id"] = call.id
        try:
            call.gen = await target.engine.submit(prompt, sampling_params(state.config, body, target.engine),
                                                  target.resolved)
        except ApiError as exc:
            if exc.status >= 500:   # the arm failed it (e.g. its engine crashed), not the client
                await call.log_failed()
            raise
        if body.stream:
            return StreamingResponse(call.events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await call.whole()

    # what differs per endpoint

    @abstractmethod
    def whole_choice(self, out: Piece, finish_reason: str) -> BaseModel: ...

    @abstractmethod
    def delta_choice(self, out: Piece | None, finish_reason: str | None = None) -> BaseModel:
        """A streamed choice: a piece of output, or (None) the finish."""

    def opening(self) -> list[BaseModel]:
        """Choices streamed before the first delta."""
        return []

    @abstractmethod
    def logged_messages(self) -> list[dict[str, str]]:
        """The prompt as the A/B table stores it."""

    # the shared core

    @property
    def deadline(self) -> float:
        return self.clock + self.state.config.request_timeout_s

    def served(self) -> dict[str, Any]:
        return {"restraint": self.route.resolved.label if self.route.resolved.restraint is not None
                or self.route.resolved.raw is not None else None,
                "experiment": self.route.experiment, "arm": self.route.arm}

    async def whole(self) -> JSONResponse:
        """Non-streaming: wait for the text, unless the client leaves or the timeout passes."""
        async with self.gen:
            text_task = asyncio.create_task(self.gen.collect())
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
            try:
                whole = text_task.result()
            except ApiError:
                await self.log_failed()
                raise
            final = self.gen.final
            usage = _usage(final.prompt_tokens, final.completion_tokens)
            await self.record(whole.text, final.finish_reason, usage)
        out = self.response_model(id=self.id, model=self.route.model_id, usage=usage, **self.served(),
                                  choices=[self.whole_choice(whole, final.finish_reason)])
        return JSONResponse(out.model_dump())

    async def events(self) -> AsyncIterator[str]:
        """Server-sent events: deltas as they are produced, the finish chunk, usage if asked, [DONE].
        A client that disconnects cancels the generation (Starlette cancels this iterator)."""
        created = int(self.started)
        pieces: list[str] = []
        async with self.gen:
            for choice in self.opening():
                yield self.chunk(created, [choice])
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
                    await self.log_failed()
                    yield _sse(exc.body())
                    return
                pieces.append(delta.text)
                yield self.chunk(created, [self.delta_choice(delta)])
            final = self.gen.final
            usage = _usage(final.prompt_tokens, final.completion_tokens)
            await self.record("".join(pieces), final.finish_reason, usage)
        yield self.chunk(created, [self.delta_choice(None, final.finish_reason)])
        if self.body.stream_options is not None and self.body.stream_options.include_usage:
            yield self.chunk(created, [], usage=usage)
        yield "data: [DONE]\n\n"

    def chunk(self, created: int, choices: list[BaseModel], *, usage: p.Usage | None = None) -> str:
        out = self.chunk_model(id=self.id, created=created, model=self.route.model_id, choices=choices, usage=usage,
                               **self.served())
        return _sse(out.model_dump(exclude_none=True))

    def timeout(self) -> ApiError:
        return ApiError(504, f"the request took longer than {self.state.config.request_timeout_s} s", code="timeout")

    async def record(self, text: str, finish_reason: str, usage: p.Usage) -> None:
        """Metrics, and for experiment requests the A/B row, written before anything is acknowledged."""
        latency = time.perf_counter() - self.clock
        self.request.state.log.update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                                      finish_reason=finish_reason)
        self.state.metrics.observe(self.route.engine.name, self.route.resolved.label, self.endpoint, 200, latency,
                                   usage.prompt_tokens, usage.completion_tokens)
        await self.log_ab(text, finish_reason, usage, latency)

    async def log_failed(self) -> None:
        """An experiment request that failed on the server's side (e.g. its engine crashed) is logged with
        finish_reason `error`, so the A/B log holds every request its arms were given."""
        await self.log_ab("", "error", _usage(0, 0), time.perf_counter() - self.clock)

    async def log_ab(self, text: str, finish_reason: str, usage: p.Usage, latency: float) -> None:
        if self.route.experiment is None:
            return
        row = {"id": self.id, "experiment": self.route.experiment, "arm": self.route.arm, "user": self.body.user,
               "model": self.route.model_id, "restraint": self.served()["restraint"], "endpoint": self.endpoint,
               "messages": self.logged_messages(), "response": text, "finish_reason": finish_reason,
               "latency_s": latency, "prompt_tokens": usage.prompt_tokens,
               "completion_tokens": usage.completion_tokens, "metadata": self.body.metadata,
               "started": self.started, "finished": time.time()}
        await asyncio.to_thread(self.state.store.log_request, row)


class ChatCall(Call):
    endpoint = "chat"
    id_prefix = "chatcmpl"
    response_model = p.ChatCompletionResponse
    chunk_model = p.ChatCompletionChunk

    def whole_choice(self, out: Piece, finish_reason: str) -> p.ChatChoice:
        return p.ChatChoice(message=p.AssistantMessage(content=out.text), finish_reason=finish_reason,
                            logprobs=self.logprobs(out.logprobs))

    def delta_choice(self, out: Piece | None, finish_reason: str | None = None) -> p.ChunkChoice:
        if out is None:
            return p.ChunkChoice(delta=p.Delta(), finish_reason=finish_reason)
        return p.ChunkChoice(delta=p.Delta(content=out.text), logprobs=self.logprobs(out.logprobs))

    def logprobs(self, tokens: list[TokenLogprob]) -> p.ChatLogprobs | None:
        if self.body.top_logprobs_count() is None:
            return None
        return p.ChatLogprobs(content=[p.TokenLogprob(**_top(t.token, t.logprob), top_logprobs=[
            p.TopLogprob(**_top(*alt)) for alt in t.top]) for t in tokens])

    def opening(self) -> list[BaseModel]:
        return [p.ChunkChoice(delta=p.Delta(role="assistant", content=""))]

    def logged_messages(self) -> list[dict[str, str]]:
        return self.prompt.messages


class TextCall(Call):
    endpoint = "completion"
    id_prefix = "cmpl"
    response_model = p.CompletionResponse
    chunk_model = p.CompletionResponse

    offset: int = 0   # text_offset of the next token

    def echoed(self) -> str:
        return self.prompt.text if self.body.echo_prompt() else ""

    def whole_choice(self, out: Piece, finish_reason: str) -> p.CompletionChoice:
        return p.CompletionChoice(text=self.echoed() + out.text, finish_reason=finish_reason,
                                  logprobs=self.logprobs(out.logprobs))

    def delta_choice(self, out: Piece | None, finish_reason: str | None = None) -> p.CompletionChoice:
        if out is None:
            return p.CompletionChoice(text="", finish_reason=finish_reason)
        return p.CompletionChoice(text=out.text, logprobs=self.logprobs(out.logprobs))

    def opening(self) -> list[BaseModel]:
        return [p.CompletionChoice(text=self.echoed())] if self.body.echo_prompt() else []

    def logprobs(self, tokens: list[TokenLogprob]) -> p.TextLogprobs | None:
        """The legacy shape; text offsets count on from the previous piece's."""
        if self.body.top_logprobs_count() is None:
            return None
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t.token)
        return p.TextLogprobs(tokens=[t.token for t in tokens], token_logprobs=[t.logprob for t in tokens],
                              top_logprobs=[None if t.logprob is None else dict(t.top) for t in tokens],
                              text_offset=offsets)

    def logged_messages(self) -> list[dict[str, str]]:
        return [{"role": "prompt", "content": self.prompt.text}]


def _top(token: str, logprob: float | None) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def _usage(prompt_tokens: int, completion_tokens: int) -> p.Usage:
    return p.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message is that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
