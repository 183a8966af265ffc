"""The `transformers` engine runs in-process over a local HF directory: a thin wrapper of the generation engine
(`generate.engine.Engine`: one KV-cache slot per request, arrivals prefilled together, each row under its own
restraint). Requests are admitted on the event loop; one scheduler thread hands them to the engine and steps it
while there is work, and each request's `Output`s become the `Piece`s and `Final` of its `Generation`."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolemrc.core.errors import InputError
from rolemrc.core.placement import DeviceMap, Dtype, check_placement
from rolemrc.generate.params import Output, Request
from rolemrc.intervene.fit import validate
from rolemrc.intervene.spec import KindUnsupportedError, Restraint
from rolemrc.serve.engines.base import (
    MODEL_DIR,
    Capabilities,
    Final,
    Generation,
    Piece,
    Prompt,
    Resolved,
    SamplingParams,
    check_token_ids,
)
from rolemrc.serve.engines.supervisor import EngineState
from rolemrc.serve.errors import ApiError, ServeConfigError

log = logging.getLogger("rolemrc.serve")


@dataclass
class TransformersOptions:
    """`path`: a model (a local HF directory, a pulled model's name or a hub id); `dtype` auto: the checkpoint's own;
    `device` auto: a GPU when there is one; `device_map`: the layers placed over the GPUs instead; `stall_after_s`:
    a step running longer than this reads `stalled` in /health; `max_model_len`: prompt + completion tokens per
    request (default: the model's context window, lowered to what the KV budget holds); `kv_cache_bytes`: the KV
    cache's budget (default: `memory_utilization` of the device memory free once the model is loaded, on a GPU; half
    the available memory on the CPU). The cache never outgrows the budget: each request holds the pages its own
    prompt and completion need, and requests wait for pages to come free."""

    path: str = field(metadata=MODEL_DIR)
    dtype: Dtype = "auto"
    device: str = "auto"
    device_map: DeviceMap | None = None
    stall_after_s: float = 60.0
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None
    memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        try:
            check_placement(self.device, self.device_map)
        except InputError as exc:
            raise ServeConfigError(str(exc)) from None
        if not self.stall_after_s > 0:
            raise ServeConfigError(f"stall_after_s must be > 0, got {self.stall_after_s}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ServeConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ServeConfigError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if not 0 < self.memory_utilization <= 1:
            raise ServeConfigError(f"memory_utilization must lie in (0, 1], got {self.memory_utilization}")


@dataclass(eq=False)
class ServeRequest(Request):
    """An engine request with the stream its outputs go to (its `emit` pushes them there) and its restraint label."""

    gen: Generation = field(kw_only=True)
    label: str = field(kw_only=True)


MIN_WINDOW = 16   # positions below which a KV budget is refused at start
CLAIMED: Counter[str] = Counter()   # KV bytes the engines serving now claimed per device (their pools grow lazily)


def kv_budget(options: TransformersOptions, model: Any) -> int:
    """The KV cache's bytes: `kv_cache_bytes`, else `memory_utilization` of the free memory of the model's GPU once it
    is loaded, else half the memory available on the host; free memory counts what the other engines on the device
    claimed as taken (their caches grow into it), so two models on one device never both count on the same bytes."""
    if options.kv_cache_bytes is not None:
        return options.kv_cache_bytes
    device = model.get_input_embeddings().weight.device
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return max(0, int((free - CLAIMED[str(device)]) * options.memory_utilization))
    return max(0, int((host_memory_available() - CLAIMED["cpu"]) * 0.5))


def host_memory_available(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes the host can give without swapping: Linux's MemAvailable (free memory and the page cache it can drop;
    free memory alone is near 0 on a machine that has just read gigabytes of files), capped by what the cgroup's
    memory limit leaves (v2 `memory.max`, v1 `memory.limit_in_bytes`; its reclaimable cache counted as free);
    elsewhere the free pages."""
    try:
        meminfo = dict(line.split(":", 1) for line in (proc / "meminfo").read_text().splitlines() if ":" in line)
        available = int(meminfo["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit, usage, stat, inactive in (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                          "memory/memory.stat", "total_inactive_file")):
        try:
            cap = int((cgroup / limit).read_text())   # v2's "max" (no limit) raises ValueError
            stats = dict(line.split() for line in (cgroup / stat).read_text().splitlines())
            used = int((cgroup / usage).read_text()) - int(stats.get(inactive, 0))
        except (OSError, ValueError):
            continue
        return max(0, min(available, cap - used))
    return available


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", code="shutting_down")


def generation_failed(why: str) -> ApiError:
    return ApiError(500, f"generation failed: {why}", code="generation_failed")


class TransformersEngine:
    """In-process engine over a local HF directory; applies restraints as runtime hooks."""

    kind = "transformers"
    Options = TransformersOptions
    capabilities = Capabilities(runtime_restraints=True, logprobs=True)

    def __init__(self, name: str, options: TransformersOptions, *, max_batch: int, max_queue: int) -> None:
        from transformers.utils import logging as hf_logging

        from rolemrc.core.modeling import context_window, load_model
        from rolemrc.generate.cache import kv_bytes_per_token
        from rolemrc.generate.engine import Engine

        hf_logging.disable_progress_bar()
        self.name = name
        self.model, self.tokenizer = load_model(options.path, dtype=options.dtype, device=options.device,
                                               device_map=options.device_map)
        self.kv_budget = kv_budget(options, self.model)
        positions = self.kv_budget // kv_bytes_per_token(self.model.config, self.model.dtype)
        self.context_window = int(min(context_window(self.model, self.tokenizer, default=2048),
                                      options.max_model_len or float("inf"), positions))
        if self.context_window < MIN_WINDOW:
            raise ServeConfigError(f"model {name!r}: a KV budget of {self.kv_budget} bytes holds {positions} "
                                   "positions; raise kv_cache_bytes or memory_utilization")
        self.window_limit = ("max_model_len" if options.max_model_len == self.context_window else
                             f"the KV budget ({self.kv_budget} bytes)" if positions == self.context_window
                             else "the model's context window")
        self.engine = Engine(self.model, self.tokenizer, max_batch=max_batch, max_length=self.context_window,
                             kv_positions=positions)
        self.kv_device = str(self.engine.device)
        CLAIMED[self.kv_device] += self.kv_budget
        self.max_queue = max_queue
        self.stall_after_s = options.stall_after_s
        self._step_began: float | None = None   # monotonic start of the step running now (scheduler thread)
        self.admitted = 0
        self.running: Counter[str] = Counter()   # replaced whole by the scheduler thread (`_publish`)
        self._submitted: deque[ServeRequest] = deque()   # not yet handed to the engine
        self._queued: Counter[str] = Counter()      # handed to the engine, waiting for a slot
        self._cv = threading.Condition()
        self._stopping = False
        self._dead: str | None = None   # why the scheduler thread ended while serving
        self.on_dead: Callable[[str, str], None] | None = None   # the server's `engine_dead` (app.lifespan sets it)
        self._thread = threading.Thread(target=self._scheduler, name=f"engine-{name}", daemon=True)

    async def start(self) -> None:
        self._thread.start()

    async def stop(self) -> None:
        """Refuse new requests and end waiting ones with 503; running ones finish."""
        with self._cv:
            self._stopping = True
            for request in self._submitted:
                request.gen.push(shutting_down())
            self._submitted.clear()
            self._cv.notify_all()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 30)
        CLAIMED[self.kv_device] -= self.kv_budget
        self.kv_budget = 0

    def health(self) -> tuple[EngineState, str | None]:
        """Dead once the scheduler thread has ended while serving; stalled while a step has run longer than
        `stall_after_s` (a step runs only while there is work)."""
        if self._dead is not None or (self._thread.ident is not None and not self._thread.is_alive()
                                      and not self._stopping):
            return "dead", self._dead or "the scheduler thread ended"
        began = self._step_began
        if began is not None and (busy := time.monotonic() - began) > self.stall_after_s:
            return "stalled", f"a generation step has run for {busy:.0f} s (stall_after_s {self.stall_after_s:g})"
        return "ok", None

    def queue_depth(self) -> Counter[str]:
        """Waiting requests per restraint label."""
        with self._cv:
            return Counter(r.label for r in self._submitted) + self._queued

    def check_restraint(self, restraint: Restraint) -> None:
        if not restraint.hooked:
            raise KindUnsupportedError(f"model {self.name!r} (transformers engine) applies restraints as runtime hooks; "
                                       f"a {restraint.kind} is baked into weights: `rolemrc intervene bake`, then serve "
                                       "the baked checkpoint as a model of its own")
        validate(restraint, self.model)

    def encode(self, prompt: Prompt) -> list[int]:
        from rolemrc.core.chat import render_chat

        if prompt.token_ids is not None:
            check_token_ids(prompt.token_ids, self.model.get_input_embeddings().num_embeddings)
            return prompt.token_ids
        text = render_chat(self.tokenizer, prompt.messages) if prompt.messages is not None else prompt.text
        return self.tokenizer(text, add_special_tokens=prompt.messages is None)["input_ids"]

    async def submit(self, prompt: Prompt, params: SamplingParams, resolved: Resolved) -> Generation:
        """Admit a request: 429 when the queue is full (before the prompt is tokenized, which runs off the event
        loop), 400 when it cannot fit the context window. `max_tokens` None: to the end of the context."""
        with self._cv:
            if self._stopping:
                raise shutting_down()
            if self._dead is not None:
                raise ApiError(503, f"model {self.name!r} cannot generate: {self._dead}", code="engine_dead")
            if self.admitted >= self.max_queue:
                raise ApiError(429, f"the queue of {self.name!r} is full ({self.max_queue} requests); retry later",
                               code="queue_full")
            self.admitted += 1
        try:
            ids, max_tokens, echo = await asyncio.to_thread(self._prepare, prompt, params)
        except BaseException:
            self._release()
            raise
        gen = Generation(len(ids), self._release)
        if echo is not None:
            gen.push(Piece(echo))
        with self._cv:
            if self._stopping:
                gen.close()
                raise shutting_down()
            self._submitted.append(ServeRequest(ids, params, max_tokens, self._emitter(gen, len(ids), max_tokens),
                                                resolved.restraint, cancelled=lambda: gen.cancelled, gen=gen,
                                                label=resolved.label))
            self._cv.notify()
        return gen

    def _prepare(self, prompt: Prompt, params: SamplingParams) -> tuple[list[int], int, str | None]:
        """The prompt's ids, the tokens it may generate and, with echo, the prompt's text (token ids decoded, as vLLM
        does): 400 for an empty prompt or one the context window cannot take."""
        ids = self.encode(prompt)
        max_tokens = self._max_tokens(prompt, params, len(ids))
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if not params.echo:
            return ids, max_tokens, None
        return ids, max_tokens, prompt.text if prompt.text is not None else self.tokenizer.decode(
            ids, clean_up_tokenization_spaces=False)

    def _max_tokens(self, prompt: Prompt, params: SamplingParams, prompt_tokens: int) -> int:
        """The tokens a request may generate: 400 when the prompt leaves no room, or `max_tokens` more than it leaves
        (a default, `fit_to_context`, is lowered to the room)."""
        room = self.context_window - prompt_tokens
        if room < 1:
            raise ApiError(400, f"the prompt has {prompt_tokens} tokens; this model takes {self.context_window} "
                                f"per request ({self.window_limit})", code="context_length_exceeded",
                           param="messages" if prompt.messages is not None else "prompt")
        if params.max_tokens is None or params.fit_to_context:
            return min(params.max_tokens or room, room)
        if params.max_tokens > room:
            raise ApiError(400, f"max_tokens {params.max_tokens} + prompt {prompt_tokens} tokens exceeds the "
                                f"{self.context_window} this model takes per request ({self.window_limit})",
                           code="context_length_exceeded", param="max_tokens")
        return params.max_tokens

    def _release(self) -> None:
        with self._cv:
            self.admitted -= 1

    def _emitter(self, gen: Generation, prompt_tokens: int, max_tokens: int) -> Callable[[Output], None]:
        """A request's `emit`: its engine outputs become `Piece`s of `gen`, its finish a `Final`."""
        def emit(output: Output) -> None:
            if output.text or output.logprobs:
                gen.push(Piece(output.text, output.logprobs))
            if output.finish_reason is None:
                return
            if output.finish_reason == "cancelled":
                log.info("cancelled", extra={"model": self.name, "completion_tokens": output.completion_tokens,
                                             "max_tokens": max_tokens})
            if output.finish_reason == "error":
                return gen.push(generation_failed("the model's logits were not finite (NaN or inf)"))
            if output.finish_reason == "out_of_memory":   # only the requests being admitted: the others go on
                return gen.push(ApiError(503, "the KV cache could not grow to admit this request (out of memory); "
                                              "retry", code="out_of_memory", retry_after=1))
            gen.push(Final(output.finish_reason, prompt_tokens, output.completion_tokens))
        return emit

    # scheduler thread -------------------------------------------------------------------------

    def _scheduler(self) -> None:
        """`_run`; if anything ends it while serving, the engine is dead: every request it holds or is handed gets
        503 `engine_dead` at once, later ones are refused at admission, and the server is told (`on_engine_dead`)."""
        try:
            self._run()
        except BaseException as exc:
            log.exception("the scheduler thread of model %r ended", self.name)
            with self._cv:
                self._dead = f"its scheduler thread ended ({type(exc).__name__})"
                dead = ApiError(503, f"model {self.name!r} cannot generate: {self._dead}", code="engine_dead")
                for request in [*self._submitted, *self.engine.waiting, *self.engine.running]:
                    request.gen.push(dead)
                self._submitted.clear()
            if self.on_dead is not None:
                self.on_dead(self.name, self._dead)

    def _run(self) -> None:
        """Hand submitted requests to the engine and step it while there is work; a failed forward ends the requests
        it was running with a 500 and the thread goes on. After `stop`, the engine's waiting requests get 503 and
        the running ones finish."""
        import torch

        with torch.inference_mode():
            while True:
                with self._cv:
                    while not (self._submitted or self._stopping or self.engine.has_work()):
                        self._cv.wait()
                    if self._stopping:
                        for request in self.engine.waiting:
                            request.gen.push(shutting_down())
                        self.engine.waiting.clear()
                    for request in self._submitted:
                        self.engine.add(request)
                    self._submitted.clear()
                    self._publish()
                    if not self.engine.has_work():
                        return
                self._step_began = time.monotonic()
                try:
                    self.engine.step()
                except Exception as exc:  # a failed forward must not take the server down
                    log.exception("generation failed")
                    for request in self.engine.fail():   # each at once, those joining its prefill group too
                        request.gen.push(generation_failed(type(exc).__name__))   # the text stays in the log
                finally:
                    self._step_began = None
                with self._cv:
                    self._publish()

    def _publish(self) -> None:
        """The labels of the engine's waiting and running requests, for `queue_depth` and `running` (under the lock)."""
        self._queued = Counter(r.label for r in self.engine.waiting)
        running = Counter(dict.fromkeys(self.running, 0))   # labels served before stay, at 0 (their gauges read 0)
        running.update(r.label for r in self.engine.running)
        self.running = running
