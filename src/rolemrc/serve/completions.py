"""Serving /v1/chat/completions and /v1/completions. `routing.route` says where a request goes and
`routing.sampling_params` how it decodes. `Call` is the shared core: route, admit one engine request per prompt and
choice, generate with timeout and disconnect handling, record, answer whole or as server-sent events. `ChatCall`
and `TextCall` only shape what differs: the response and chunk objects, and how the prompt is logged.

A request with several prompts or `n` > 1 fans out here, so every engine sees one prompt per `submit`: choice
`index` is `p * n + k` for prompt p and sample k (vLLM's order), sample k samples with `seed + k`, usage counts
each prompt's tokens once and every choice's completion tokens. The request has one id, one deadline and one
metrics entry; the A/B log gets one row per choice (id `<id>` for a single choice, else `<id>:<index>`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from rolemrc.generate.params import SamplingParams, TokenLogprob
from rolemrc.serve import idempotency, outcome
from rolemrc.serve import protocol as p
from rolemrc.serve.engines.base import Engine, Generation, Piece, Prompt, Resolved
from rolemrc.serve.errors import ApiError
from rolemrc.serve.limits import check_limits, key_share
from rolemrc.serve.outcome import Ended, disconnected, internal_error, render, shut_down
from rolemrc.serve.routing import Route, route, sampling_params
from rolemrc.serve.state import State, app_state

log = logging.getLogger("rolemrc.serve")


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
    tasks = [asyncio.ensure_future(engine.submit(prompt, sp, resolved)) for prompt, _, sp in asks]
    try:
        gens = await asyncio.gather(*tasks, return_exceptions=True)
    except asyncio.CancelledError:   # abandoned while admitting: what was admitted is closed, the rest cancelled
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            gens = await asyncio.gather(*tasks, return_exceptions=True)
        for gen in gens:
            if isinstance(gen, Generation):
                gen.close()
        raise
    refused = next((g for g in gens if isinstance(g, BaseException)), None)
    if refused is not None:
        for gen in gens:
            if isinstance(gen, Generation):
                gen.close()
        raise refused
    return [Choice(i, prompt, gen, k == 0) for i, ((prompt, k, _), gen) in enumerate(zip(asks, gens))]


@dataclass(eq=False)
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
    route: Route
    id: str
    started: float
    clock: float
    key: str | None = None    # its claimed idempotency key (experiment requests)
    claim: idempotency.Claim | None = None   # that key's claim: whose it is, and the fencing token
    choices: list[Choice] = field(default_factory=list)    # set once admitted
    outs: list[Piece] = field(default_factory=list)        # each choice's output so far
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)   # (choice position, Piece | None: done | Ended)
    logged: bool = False
    share: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)   # its key_share

    @classmethod
    async def serve(cls, request: Request, body: p.SamplingFields, prompts: list[Prompt]) -> Response:
        """Pick model and restraint (or an experiment's arm), claim its idempotency key, admit, and answer whole or
        streamed; every experiment request that gets past routing is logged once, however it ends."""
        state = app_state(request)
        started, clock = time.time(), time.perf_counter()
        target = await route(state, body)
        info = request.state.log
        info.update(model=target.model_id, restraint=target.resolved.label, experiment=target.experiment,
                    arm=target.arm)
        call = cls(state, request, body, prompts, target, p.new_id(cls.id_prefix), started, clock)
        info["id"] = call.id
        if target.experiment is not None and (key := idempotency.header(request)) is not None:
            held = await idempotency.claim(state.store, request, body, target.experiment, key,
                                           state.config.request_timeout_s + state.config.shutdown_grace_s)
            if not isinstance(held, idempotency.Claim):
                return call.replay(held)
            call.key, call.claim = key, held
        try:
            if target.refused is not None:   # the arm it was assigned cannot serve it
                raise target.refused
            params = sampling_params(state.config, body, target.engine)
            call.share.enter_context(key_share(state, request, target.engine.name, len(prompts) * body.n))
            call.choices = await submit_all(target.engine, prompts, params, body.n, target.resolved)
        except Exception as exc:
            call.share.close()
            error = exc if isinstance(exc, ApiError) else internal_error(exc)
            # refused once its arm was assigned, it is logged too (arms refuse different requests: unlogged refusals
            # would leave each arm's rows a differently biased sample); a refusal frees its key, as a 5xx does
            await call.commit(outcome.refusal(error), error.body())
            raise target.conceal(error) from None
        except asyncio.CancelledError:   # the client left (or the server is stopping) while it was admitted
            call.share.close()
            await call.commit_quietly(call.interrupted())
            raise
        call.outs = [Piece("") for _ in call.choices]
        state.calls.add(call)
        if body.stream:
            return CallStream(call)
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
    def replayed_deltas(self, choice: dict[str, Any]) -> list[BaseModel]:
        """A stored whole choice as streamed choices: its content, then its finish."""

    @abstractmethod
    def logged_messages(self, prompt: Prompt) -> list[dict[str, Any]]:
        """The prompt as the A/B table stores it."""

    # the shared core

    @property
    def deadline(self) -> float:
        return self.clock + self.state.config.request_timeout_s

    def restraint(self) -> str | None:
        """The label of the restraint serving it, None when unrestrained."""
        resolved = self.route.resolved
        return resolved.label if resolved.restraint is not None or resolved.raw is not None else None

    def served(self) -> dict[str, Any]:
        """What served it, as its response and chunks say: the variant (`model`), `restraint`, `experiment`, `arm`.
        An experiment that hides its arms (`reveal_arm` false) says none of it: `model` is the one the client sent."""
        if not self.route.reveal:
            return {"model": self.body.model, "restraint": None, "experiment": None, "arm": None}
        return {"model": self.route.model_id, "restraint": self.restraint(), "experiment": self.route.experiment,
                "arm": self.route.arm}

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """The admitted call answering; released however that ends."""
        try:
            yield
        finally:
            self.release()

    def release(self) -> None:
        """Out of the server's in-flight calls, every generation closed (cancelled, so the engine stops decoding it,
        if unfinished: its slot and any adapter hold freed) and the key's share returned. Idempotent."""
        self.state.calls.discard(self)
        for choice in self.choices:
            choice.gen.close()
        self.share.close()

    async def abandoned(self) -> None:
        """A streamed call whose response ended without its events running to their end (the client left before the
        first byte, or while a chunk was being sent): logged as interrupted, unless it was, and released."""
        if not self.logged:
            await self.commit_quietly(self.interrupted())
        self.release()

    def shut_down(self) -> None:
        """End the request now (the server's shutdown grace has passed): its rows are logged `shutdown`."""
        self.queue.put_nowait((-1, shut_down()))

    def interrupted(self) -> Ended:
        """Why a request was torn down from outside (its task cancelled): past its deadline (a reader too slow to take
        what was sent), the server's shutdown, else its client leaving."""
        if time.perf_counter() >= self.deadline:
            return Ended("timeout", self.timeout())
        return shut_down() if self.state.draining else Ended("disconnected", disconnected())

    async def pieces(self) -> AsyncIterator[tuple[int, Piece]]:
        """Every choice's pieces as they come (position in `choices`, piece), kept in `outs`; raises Ended on a
        timeout, an engine's error, a disconnect or shutdown put on the queue."""
        pumps = [asyncio.create_task(self._pump(i, c.gen)) for i, c in enumerate(self.choices)]
        try:
            left = len(self.choices)
            while left:
                try:
                    i, item = await asyncio.wait_for(self.queue.get(), max(0.0, self.deadline - time.perf_counter()))
                except TimeoutError:
                    raise Ended("timeout", self.timeout()) from None
                if isinstance(item, Ended):
                    raise item
                if item is None:
                    left -= 1
                    continue
                self.outs[i].text += item.text
                self.outs[i].logprobs += item.logprobs
                yield i, item
        finally:
            for task in pumps:
                task.cancel()

    async def _pump(self, i: int, gen: Generation) -> None:
        try:
            async for piece in gen:
                self.queue.put_nowait((i, piece))
            self.queue.put_nowait((i, None))
        except ApiError as exc:
            self.queue.put_nowait((i, Ended("shutdown" if exc.code == "shutting_down" else "error", exc)))
        except Exception as exc:
            self.queue.put_nowait((i, Ended("error", internal_error(exc))))

    async def _watch_disconnect(self) -> None:
        await _disconnected(self.request)
        self.queue.put_nowait((-1, Ended("disconnected", disconnected())))

    async def whole(self) -> Response:
        """Non-streaming: wait for every choice, unless the client leaves, the timeout passes or the server shuts
        down; the body is rendered before its rows are committed."""
        gone = asyncio.create_task(self._watch_disconnect())
        async with self.held():
            try:
                async for _ in self.pieces():
                    pass
                usage = self.usage()
                body = self.whole_body(usage)
                content = render(body)
                await self.commit(None, body)
            except Ended as end:
                await self.commit(end.reason, end.error.body())
                raise self.route.conceal(end.error) from None
            except asyncio.CancelledError:
                await self.commit_quietly(self.interrupted())
                raise
            except ApiError:   # the store refused the rows
                raise
            except Exception as exc:
                error = internal_error(exc)
                await self.commit("error", error.body())
                raise error from None
            finally:
                gone.cancel()
        self.observe(usage)
        return Response(content, media_type="application/json")

    async def events(self) -> AsyncIterator[str]:
        """Server-sent events: deltas as they are produced (each tagged with its choice's index), the finish
        chunks, usage if asked, [DONE] once the rows are committed; an error event instead when the request cannot
        complete. A client that disconnects cancels the generation (Starlette cancels this iterator)."""
        created = int(self.started)
        async with self.held():
            try:
                for choice in self.choices:
                    for opening in self.opening(choice):
                        yield self.chunk(created, [opening])
                async for i, piece in self.pieces():
                    yield self.chunk(created, [self.delta_choice(self.choices[i], piece)])
                usage = self.usage()
                await self.commit(None, self.whole_body(usage) if self.key is not None else None)
            except Ended as end:
                try:
                    await self.commit(end.reason, end.error.body())
                except ApiError as store:
                    end.error = store
                yield p.sse(self.route.conceal(end.error).body())
                return
            except ApiError as store:   # the store refused the rows
                yield p.sse(store.body())
                return
            except (asyncio.CancelledError, GeneratorExit):
                await self.commit_quietly(self.interrupted())
                raise
            except Exception as exc:
                error = internal_error(exc)
                await self.commit_quietly(Ended("error", error))
                yield p.sse(error.body())
                return
        self.observe(usage)
        for choice in self.choices:
            yield self.chunk(created, [self.delta_choice(choice, None, choice.gen.final.finish_reason)])
        if self.body.stream_options is not None and self.body.stream_options.include_usage:
            yield self.chunk(created, [], usage=usage)
        yield "data: [DONE]\n\n"

    def whole_body(self, usage: p.Usage) -> dict[str, Any]:
        """The whole response (also what a streamed request's idempotency key replays)."""
        for choice in self.choices:
            choice.offset = 0
        choices = [self.whole_choice(c, out, c.gen.final.finish_reason) for c, out in zip(self.choices, self.outs)]
        return self.response_model(id=self.id, usage=usage, **self.served(), choices=choices).model_dump()

    def replay(self, stored: dict[str, Any]) -> Response:
        """The response stored under the request's idempotency key, whole or as server-sent events."""
        usage = self.body.stream_options is not None and self.body.stream_options.include_usage
        return idempotency.replay(stored, self.body.stream, usage, self.chunk_model, self.replayed_deltas)

    def chunk(self, created: int, choices: list[BaseModel], *, usage: p.Usage | None = None) -> str:
        out = self.chunk_model(id=self.id, created=created, choices=choices, usage=usage, **self.served())
        return p.sse(out.model_dump(exclude_none=True))

    def timeout(self) -> ApiError:
        return ApiError(504, f"the request took longer than {self.state.config.request_timeout_s} s", code="timeout")

    def usage(self) -> p.Usage:
        """Each prompt's tokens once, every choice's completion tokens (as vLLM and OpenAI count)."""
        prompt = sum(c.gen.final.prompt_tokens for c in self.choices if c.counted)
        completion = sum(c.gen.final.completion_tokens for c in self.choices)
        return p.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def observe(self, usage: p.Usage) -> None:
        """Metrics and the access log of a request answered in full."""
        reasons = [c.gen.final.finish_reason for c in self.choices]
        self.request.state.log.update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                                      finish_reason=reasons[0] if len(set(reasons)) == 1 else reasons)
        self.state.metrics.observe(self.route.engine.name, self.route.resolved.label, self.endpoint, 200,
                                   time.perf_counter() - self.clock, usage.prompt_tokens, usage.completion_tokens)

    async def commit(self, reason: str | None, response: dict[str, Any] | None) -> None:
        """For an experiment request, once: its A/B rows (`outcome.rows`; `reason` the finish_reason of all of them
        when it did not complete, `response` then the error its client got) and, with an idempotency key, the
        response its client got (stored to replay when it completed; an outcome that tells the client to retry, or
        a refusal, frees the key instead), in one transaction before anything is acknowledged. 503 with the store's
        code when the database refuses."""
        if self.route.experiment is None or self.logged:
            return
        self.logged = True
        failed = response["error"] if reason is not None and response and "error" in response else None
        final = response if self.claim is not None and reason is None else None   # else the key is freed
        await outcome.write(self.state.store, outcome.rows(self, reason, failed), self.claim, final)

    async def commit_quietly(self, end: Ended) -> None:
        """`commit` for a request whose client can no longer be told that the store refused."""
        try:
            await self.commit(end.reason, end.error.body())
        except ApiError as exc:
            log.error("A/B rows not written: %s", exc.message, extra={"id": self.id})


SEND_GRACE_S = 1.0   # past its deadline, a stream has this long to send its timeout event before it is cut off


class CallStream(StreamingResponse):
    """A call's server-sent events, which end the call however the response stops. A client gone while the call was
    routed or admitted makes the disconnect the first thing the response hears; whether the iterator has started
    (and its own `except` runs) before that cancellation lands is up to the scheduler, and a send cut off by the
    deadline leaves it suspended at a `yield`: so the events are closed here, and a call they did not end is logged
    and released."""

    def __init__(self, call: Call) -> None:
        super().__init__(call.events(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.call = call

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:   # the deadline covers sending too: a client that stops reading blocks `send`, not the generation
            with anyio.move_on_after(max(0.0, self.call.deadline - time.perf_counter()) + SEND_GRACE_S):
                await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()   # a started stream ends as its own code says
                await self.call.abandoned()


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

    def replayed_deltas(self, choice: dict[str, Any]) -> list[BaseModel]:
        return [p.ChunkChoice(index=choice["index"], delta=p.Delta(role="assistant", content=choice["message"]["content"]),
                              logprobs=choice.get("logprobs")),
                p.ChunkChoice(index=choice["index"], delta=p.Delta(), finish_reason=choice["finish_reason"])]

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

    def replayed_deltas(self, choice: dict[str, Any]) -> list[BaseModel]:
        return [p.CompletionChoice(index=choice["index"], text=choice["text"], logprobs=choice.get("logprobs")),
                p.CompletionChoice(index=choice["index"], text="", finish_reason=choice["finish_reason"])]

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


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message is that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
