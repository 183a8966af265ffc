"""Serving /v1/chat/completions and /v1/completions. `route` says where a request goes: its model and restraint (from
the model id, the `restraint` field, or an experiment's arm), `sampling_params` its decoding settings within the
server's limits. `Call` is the shared core: route, admit one engine request per prompt and choice, generate with
timeout and disconnect handling, record, answer whole or as server-sent events. `ChatCall` and `TextCall` only
shape what differs: the response and chunk objects, and how the prompt is logged.

A request with several prompts or `n` > 1 fans out here, so every engine sees one prompt per `submit`: choice
`index` is `p * n + k` for prompt p and sample k (vLLM's order), sample k samples with `seed + k`, usage counts
each prompt's tokens once and every choice's completion tokens. The request has one id, one deadline and one
metrics entry; the A/B log gets one row per choice (id `<id>` for a single choice, else `<id>:<index>`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from rolemrc.generate.params import SamplingParams, TokenLogprob
from rolemrc.serve import protocol as p
from rolemrc.serve.config import ServeConfig
from rolemrc.serve.engines.base import Engine, Final, Generation, Piece, Prompt, Resolved
from rolemrc.serve.errors import ApiError
from rolemrc.serve.experiments import assign
from rolemrc.serve.limits import check_limits, key_share
from rolemrc.serve.state import State, app_state


async def chat_completion(request: Request, body: p.ChatCompletionRequest) -> Response:
    check_limits(app_state(request).config, body, 1)
    return await ChatCall.serve(request, body, [Prompt(messages=[m.turn() for m in body.messages])])


async def text_completion(request: Request, body: p.CompletionRequest) -> Response:
    prompts = body.prompts()
    if not prompts:
        raise ApiError(400, "the prompt list is empty", param="prompt")
    check_limits(app_state(request).config, body, len(prompts))
    return await TextCall.serve(request, body, [_text_prompt(item) for item in prompts])


def _text_prompt(item: str | list[int]) -> Prompt:
    if isinstance(item, str):
        return Prompt(text=item)
    if not item:
        raise ApiError(400, "a token-id prompt is empty", param="prompt")
    if min(item) < 0:
        raise ApiError(400, f"token id {min(item)} is negative", param="prompt")
    return Prompt(token_ids=item)


@dataclass
class Route:
    """Where one request goes."""

    model_id: str
    engine: Engine
    resolved: Resolved
    experiment: str | None = None
    arm: str | None = None


async def route(state: State, body: p.SamplingFields) -> Route:
    """The request's model and restraint: from the model id and `restraint`, or from the arm its user is assigned."""
    catalog = state.catalog
    if body.experiment is None:
        engine, named = catalog.lookup(body.model)
        return Route(body.model, engine, catalog.resolve(engine, named, body.restraint))
    if body.restraint is not None:
        raise ApiError(400, "a request in an experiment gets its restraint from the arm; drop 'restraint'",
                       param="restraint")
    exp = await state.experiment(body.experiment)
    arm = assign(exp["id"], exp["arms"], body.user)
    engine, named = catalog.lookup(arm["model"])
    if named is None and arm.get("restraint"):
        resolved = catalog.resolve(engine, None, arm["restraint"])
    else:
        resolved = catalog.resolve(engine, named, None)
    model_id = arm["model"] if named or not arm.get("restraint") else f"{arm['model']}+{arm['restraint']}"
    return Route(model_id, engine, resolved, exp["id"], arm["name"])


def sampling_params(config: ServeConfig, body: p.SamplingFields, engine: Engine) -> SamplingParams:
    """The request's decoding settings, `max_tokens` always set (the server's default when the client gave none, which
    an engine that knows the context window lowers to the room the prompt leaves); 400 for what this server or
    `engine` does not honour."""
    if (refused := body.refused()) is not None:
        raise ApiError(400, refused[1], code="unsupported_parameter", param=refused[0])
    logprobs = body.top_logprobs_count()
    if logprobs is not None and not engine.capabilities.logprobs:
        raise ApiError(400, f"the {engine.kind} engine serving this model does not return logprobs",
                       code="unsupported_parameter", param="logprobs")
    response_format = body.response_format.constrained() if getattr(body, "response_format", None) else None
    if response_format is not None and not engine.capabilities.structured_outputs:
        raise ApiError(400, f"the {engine.kind} engine serving this model cannot constrain replies to "
                            f"{response_format['type']} (serve it with engine: vllm)",
                       code="unsupported_parameter", param="response_format")
    max_tokens = body.requested_max_tokens()
    if max_tokens is not None and max_tokens > config.max_new_tokens:
        raise ApiError(400, f"max_tokens {max_tokens} is over this server's limit of {config.max_new_tokens}",
                       code="max_tokens_too_large", param="max_tokens")
    return SamplingParams(max_tokens=config.default_max_tokens if max_tokens is None else max_tokens,
                          fit_to_context=max_tokens is None, temperature=body.temperature, top_p=body.top_p,
                          seed=body.seed, stop=body.stops(), ignore_eos=body.ignore_eos, logprobs=logprobs,
                          echo=body.echo_prompt(), prompt_logprobs=logprobs is not None and body.echo_prompt(),
                          response_format=response_format)


@dataclass
class Choice:
    """One engine request of a call: choice `index` of `prompt`; `counted`: the first sample of its prompt (whose
    prompt tokens count in usage)."""

    index: int
    prompt: Prompt
    gen: Generation
    counted: bool
    offset: int = 0   # completions: text_offset of the next token


async def submit_all(engine: Engine, prompts: list[Prompt], params: SamplingParams, n: int,
                     resolved: Resolved) -> list[Choice]:
    """Admit one request per prompt and sample, concurrently, all or none: 429 before anything is built when the
    queue has no room for all; if one is refused, the others are closed and its error raised."""
    if engine.admitted + len(prompts) * n > engine.max_queue:
        raise ApiError(429, f"the queue of {engine.name!r} has room for {max(0, engine.max_queue - engine.admitted)} "
                            f"requests, not {len(prompts) * n}; retry later", code="queue_full")
    asks = [(prompt, k, params if params.seed is None or k == 0 else dataclasses.replace(params, seed=params.seed + k))
            for prompt in prompts for k in range(n)]
    gens = await asyncio.gather(*(engine.submit(prompt, sp, resolved) for prompt, _, sp in asks), return_exceptions=True)
    refused = next((g for g in gens if isinstance(g, BaseException)), None)
    if refused is not None:
        for gen in gens:
            if isinstance(gen, Generation):
                gen.close()
        raise refused
    return [Choice(i, prompt, gen, k == 0) for i, ((prompt, k, _), gen) in enumerate(zip(asks, gens))]


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
    prompts: list[Prompt]
    choices: list[Choice]     # set once admitted
    route: Route
    id: str
    started: float
    clock: float
    share: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack)   # its key_share

    @classmethod
    async def serve(cls, request: Request, body: p.SamplingFields, prompts: list[Prompt]) -> Response:
        """Pick model and restraint (or an experiment's arm), admit, and answer whole or streamed."""
        state = app_state(request)
        started, clock = time.time(), time.perf_counter()
        target = await route(state, body)
        info = request.state.log
        info.update(model=target.model_id, restraint=target.resolved.label, experiment=target.experiment,
                    arm=target.arm)
        call = cls(state, request, body, prompts, [], target, p.new_id(cls.id_prefix), started, clock)
        info["id"] = call.id
        params = sampling_params(state.config, body, target.engine)
        call.share.enter_context(key_share(state, request, target.engine.name, len(prompts) * body.n))
        try:
            call.choices = await submit_all(target.engine, prompts, params, body.n, target.resolved)
        except ApiError as exc:
            call.share.close()
            if exc.status >= 500:   # the arm failed it (e.g. its engine crashed), not the client
                await call.log_failed()
            raise
        except BaseException:
            call.share.close()
            raise
        if body.stream:
            return StreamingResponse(call.events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await call.whole()

    # what differs per endpoint

    @abstractmethod
    def whole_choice(self, choice: Choice, out: Piece, finish_reason: str) -> BaseModel: ...

    @abstractmethod
    def delta_choice(self, choice: Choice, out: Piece | None, finish_reason: str | None = None) -> BaseModel:
        """A streamed choice: a piece of output, or (None) the finish."""

    def opening(self, choice: Choice) -> list[BaseModel]:
        """Choices streamed before the first delta."""
        return []

    @abstractmethod
    def logged_messages(self, prompt: Prompt) -> list[dict[str, Any]]:
        """The prompt as the A/B table stores it."""

    # the shared core

    @property
    def deadline(self) -> float:
        return self.clock + self.state.config.request_timeout_s

    def served(self) -> dict[str, Any]:
        return {"restraint": self.route.resolved.label if self.route.resolved.restraint is not None
                or self.route.resolved.raw is not None else None,
                "experiment": self.route.experiment, "arm": self.route.arm}

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """Every generation of the call, closed (cancelled if unfinished), and its key's share, released on the way
        out."""
        try:
            yield
        finally:
            for choice in self.choices:
                choice.gen.close()
            self.share.close()

    def cancel(self) -> None:
        for choice in self.choices:
            choice.gen.cancel()

    async def whole(self) -> JSONResponse:
        """Non-streaming: wait for every choice, unless the client leaves or the timeout passes."""
        async with self.held():
            tasks = [asyncio.create_task(c.gen.collect()) for c in self.choices]
            outs = asyncio.gather(*tasks)
            gone = asyncio.create_task(_disconnected(self.request))
            try:
                done, _ = await asyncio.wait({outs, gone}, timeout=max(0.0, self.deadline - time.perf_counter()),
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                for task in tasks:
                    task.cancel()
            if outs not in done:
                self.cancel()
                if gone in done:
                    return JSONResponse({"error": {"message": "client disconnected", "type": "cancelled",
                                                   "param": None, "code": None}}, status_code=499)
                raise self.timeout()
            try:
                pieces = outs.result()
            except ApiError:
                await self.log_failed()
                raise
            usage = self.usage()
            await self.record([out.text for out in pieces], usage)
        choices = [self.whole_choice(c, out, c.gen.final.finish_reason) for c, out in zip(self.choices, pieces)]
        out = self.response_model(id=self.id, model=self.route.model_id, usage=usage, **self.served(), choices=choices)
        return JSONResponse(out.model_dump())

    async def events(self) -> AsyncIterator[str]:
        """Server-sent events: deltas as they are produced (each tagged with its choice's index), the finish
        chunks, usage if asked, [DONE]. A client that disconnects cancels the generation (Starlette cancels this
        iterator)."""
        created = int(self.started)
        texts = [""] * len(self.choices)
        async with self.held():
            for choice in self.choices:
                for opening in self.opening(choice):
                    yield self.chunk(created, [opening])
            stream = _merged([c.gen for c in self.choices])
            try:
                while True:
                    try:
                        i, delta = await asyncio.wait_for(stream.__anext__(),
                                                          max(0.0, self.deadline - time.perf_counter()))
                    except StopAsyncIteration:
                        break
                    except (TimeoutError, asyncio.TimeoutError):
                        self.cancel()
                        yield _sse(self.timeout().body())
                        return
                    except ApiError as exc:
                        await self.log_failed()
                        yield _sse(exc.body())
                        return
                    texts[i] += delta.text
                    yield self.chunk(created, [self.delta_choice(self.choices[i], delta)])
            finally:
                await stream.aclose()
            usage = self.usage()
            await self.record(texts, usage)
        for choice in self.choices:
            yield self.chunk(created, [self.delta_choice(choice, None, choice.gen.final.finish_reason)])
        if self.body.stream_options is not None and self.body.stream_options.include_usage:
            yield self.chunk(created, [], usage=usage)
        yield "data: [DONE]\n\n"

    def chunk(self, created: int, choices: list[BaseModel], *, usage: p.Usage | None = None) -> str:
        out = self.chunk_model(id=self.id, created=created, model=self.route.model_id, choices=choices, usage=usage,
                               **self.served())
        return _sse(out.model_dump(exclude_none=True))

    def timeout(self) -> ApiError:
        return ApiError(504, f"the request took longer than {self.state.config.request_timeout_s} s", code="timeout")

    def usage(self) -> p.Usage:
        """Each prompt's tokens once, every choice's completion tokens (as vLLM and OpenAI count)."""
        prompt = sum(c.gen.final.prompt_tokens for c in self.choices if c.counted)
        completion = sum(c.gen.final.completion_tokens for c in self.choices)
        return p.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    async def record(self, texts: list[str], usage: p.Usage) -> None:
        """Metrics, and for experiment requests the A/B rows (one per choice), written before anything is
        acknowledged."""
        latency = time.perf_counter() - self.clock
        reasons = [c.gen.final.finish_reason for c in self.choices]
        self.request.state.log.update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                                      finish_reason=reasons[0] if len(set(reasons)) == 1 else reasons)
        self.state.metrics.observe(self.route.engine.name, self.route.resolved.label, self.endpoint, 200, latency,
                                   usage.prompt_tokens, usage.completion_tokens)
        await self.log_ab([(c.index, c.prompt, text, c.gen.final) for c, text in zip(self.choices, texts)], latency)

    async def log_failed(self) -> None:
        """An experiment request that failed on the server's side (e.g. its engine crashed) is logged with
        finish_reason `error`, a row per choice it asked for, so the A/B log holds every request its arms were given."""
        n = self.body.n
        asked = [(i * n + k, prompt, "", None) for i, prompt in enumerate(self.prompts) for k in range(n)]
        await self.log_ab(asked, time.perf_counter() - self.clock)

    async def log_ab(self, choices: list[tuple[int, Prompt, str, Final | None]], latency: float) -> None:
        """The A/B rows of an experiment request, one per choice (index, prompt, text, its final or None: failed)."""
        if self.route.experiment is None:
            return
        finished = time.time()
        for index, prompt, text, final in choices:
            row = {"id": self.id if len(choices) == 1 else f"{self.id}:{index}", "experiment": self.route.experiment,
                   "arm": self.route.arm, "user": self.body.user, "model": self.route.model_id,
                   "restraint": self.served()["restraint"], "endpoint": self.endpoint,
                   "messages": self.logged_messages(prompt), "response": text,
                   "finish_reason": final.finish_reason if final else "error", "latency_s": latency,
                   "prompt_tokens": final.prompt_tokens if final else 0,
                   "completion_tokens": final.completion_tokens if final else 0, "metadata": self.body.metadata,
                   "started": self.started, "finished": finished}
            await asyncio.to_thread(self.state.store.log_request, row)


class ChatCall(Call):
    endpoint = "chat"
    id_prefix = "chatcmpl"
    response_model = p.ChatCompletionResponse
    chunk_model = p.ChatCompletionChunk

    def whole_choice(self, choice: Choice, out: Piece, finish_reason: str) -> p.ChatChoice:
        return p.ChatChoice(index=choice.index, message=p.AssistantMessage(content=out.text),
                            finish_reason=finish_reason, logprobs=self.logprobs(out.logprobs))

    def delta_choice(self, choice: Choice, out: Piece | None, finish_reason: str | None = None) -> p.ChunkChoice:
        if out is None:
            return p.ChunkChoice(index=choice.index, delta=p.Delta(), finish_reason=finish_reason)
        return p.ChunkChoice(index=choice.index, delta=p.Delta(content=out.text), logprobs=self.logprobs(out.logprobs))

    def logprobs(self, tokens: list[TokenLogprob]) -> p.ChatLogprobs | None:
        if self.body.top_logprobs_count() is None:
            return None
        return p.ChatLogprobs(content=[p.TokenLogprob(**_top(t.token, t.logprob), top_logprobs=[
            p.TopLogprob(**_top(*alt)) for alt in t.top]) for t in tokens])

    def opening(self, choice: Choice) -> list[BaseModel]:
        return [p.ChunkChoice(index=choice.index, delta=p.Delta(role="assistant", content=""))]

    def logged_messages(self, prompt: Prompt) -> list[dict[str, Any]]:
        return prompt.messages


class TextCall(Call):
    """Completions; with `echo` the engine's output starts with the prompt's text (and, with logprobs, its
    tokens' entries)."""

    endpoint = "completion"
    id_prefix = "cmpl"
    response_model = p.CompletionResponse
    chunk_model = p.CompletionResponse

    def whole_choice(self, choice: Choice, out: Piece, finish_reason: str) -> p.CompletionChoice:
        return p.CompletionChoice(index=choice.index, text=out.text, finish_reason=finish_reason,
                                  logprobs=self.logprobs(choice, out.logprobs))

    def delta_choice(self, choice: Choice, out: Piece | None, finish_reason: str | None = None) -> p.CompletionChoice:
        if out is None:
            return p.CompletionChoice(index=choice.index, text="", finish_reason=finish_reason)
        return p.CompletionChoice(index=choice.index, text=out.text, logprobs=self.logprobs(choice, out.logprobs))

    def logprobs(self, choice: Choice, tokens: list[TokenLogprob]) -> p.TextLogprobs | None:
        """The legacy shape: each token's alternatives hold the token itself and the k best (as vLLM and OpenAI);
        text offsets count on from the choice's previous piece."""
        if self.body.top_logprobs_count() is None:
            return None
        offsets = []
        for t in tokens:
            offsets.append(choice.offset)
            choice.offset += len(t.token)
        return p.TextLogprobs(tokens=[t.token for t in tokens], token_logprobs=[t.logprob for t in tokens],
                              top_logprobs=[None if t.logprob is None else {t.token: t.logprob, **dict(t.top)}
                                            for t in tokens],
                              text_offset=offsets)

    def logged_messages(self, prompt: Prompt) -> list[dict[str, Any]]:
        if prompt.token_ids is not None:
            return [{"role": "prompt", "token_ids": prompt.token_ids}]
        return [{"role": "prompt", "content": prompt.text}]


def _top(token: str, logprob: float | None) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


async def _merged(gens: list[Generation]) -> AsyncIterator[tuple[int, Piece]]:
    """The pieces of several generations as they come, each with its generation's position."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for piece in gen:
                queue.put_nowait((i, piece))
            queue.put_nowait((i, None))
        except Exception as exc:   # an engine's error (ApiError), raised where the pieces are read
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                left -= 1
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message is that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
