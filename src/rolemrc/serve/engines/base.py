"""The engine contract: what the server hands an engine (a `Prompt`, `SamplingParams`, a `Resolved` restraint),
what it gets back (a `Generation` streaming text deltas, then a `Final`), and what an engine declares about
itself (`Capabilities`, its options dataclass)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from rolemrc.generate.params import SamplingParams, TokenLogprob
from rolemrc.intervene.spec import Restraint
from rolemrc.serve.errors import ApiError

LOCAL_PATH = {"local_path": True}   # field metadata: a path resolved against the config file's folder
MODEL_DIR = {**LOCAL_PATH, "model_dir": True}   # ... or a model name (a pulled model, a hub id) that must resolve to a
#                                                   Hugging Face model (checked before serving)


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do beyond plain generation; the server asks these, never the engine's name."""

    runtime_restraints: bool = False   # applies restraints itself (registered, inline, `model+restraint`)
    lora_restraints: bool = False      # ... as LoRA adapters, told the registered ones by `register_adapters`
    logprobs: bool = False             # returns token log-probabilities
    structured_outputs: bool = False   # constrains decoding to `response_format` (JSON object / JSON Schema)


@dataclass
class Piece:
    """A stretch of streamed output: text and the log-probabilities of the tokens it came from (when asked;
    text may be empty, e.g. for the prompt's log-probabilities, or trail its tokens across pieces)."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Prompt:
    """A chat (`messages`), a raw text prompt, or token ids (ints >= 0; engines check them against their vocabulary
    with `check_token_ids`)."""

    messages: list[dict[str, str]] | None = None
    text: str | None = None
    token_ids: list[int] | None = None


def check_token_ids(ids: list[int], vocab: int) -> None:
    """400 naming `prompt` for a token id outside [0, vocab)."""
    if ids and max(ids) >= vocab:
        raise ApiError(400, f"token id {max(ids)} is outside this model's vocabulary of {vocab}", param="prompt")


ClientRestraint = str | dict[str, Any]   # what a request's `restraint` field holds: a registered name or a spec


@dataclass
class Resolved:
    """A restraint resolved for one request: the Restraint (engines with `runtime_restraints`; it passed the
    engine's `check_restraint`, so engines apply it without validating it again), its metric label, its identity
    (`name:<name>` for a registered one, `inline:<Restraint.digest>`, or empty: what vLLM's adapter names follow) and
    what the client sent (forwarded by upstream engines)."""

    restraint: Restraint | None = None
    label: str = "none"
    key: str = ""
    raw: ClientRestraint | None = None


@dataclass
class Final:
    finish_reason: str          # stop | length | cancelled
    prompt_tokens: int
    completion_tokens: int


class Generation:
    """Handle on one admitted request: the stream of an engine. Iterate it for `Piece`s; `final` is set
    at the end. Leaving `async with` cancels an unfinished generation and frees its admission slot."""

    def __init__(self, prompt_tokens: int, release: Any, on_cancel: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt_tokens = prompt_tokens
        self.final: Final | None = None
        self._cancel = threading.Event()
        self._release = release
        self._on_cancel = on_cancel

    def push(self, item: str | Piece | Final | BaseException) -> None:
        """Thread-safe: deliver a text delta or a Piece, the Final, or an error."""
        with contextlib.suppress(RuntimeError):   # a closed loop: nobody is listening
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def __aiter__(self) -> AsyncIterator[Piece]:
        while self.final is None:
            item = await self.queue.get()
            if isinstance(item, Final):
                self.final = item
            elif isinstance(item, BaseException):
                raise item
            elif isinstance(item, str):
                if item:
                    yield Piece(item)
            elif item.text or item.logprobs:
                yield item

    async def text(self) -> str:
        return (await self.collect()).text

    async def collect(self) -> Piece:
        """The whole output as one Piece."""
        pieces = [piece async for piece in self]
        return Piece("".join(x.text for x in pieces), [lp for x in pieces for lp in x.logprobs])

    def cancel(self) -> None:
        self._cancel.set()
        if self._on_cancel is not None:
            self._on_cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.final is None:
            self.cancel()
        if self._release is not None:
            self._release()
            self._release = None


class Engine(Protocol):
    """What serves one model. `Options` is the dataclass its config keys fill (one field per key, `Literal`
    for choices, `LOCAL_PATH` metadata on paths, `MODEL_DIR` on model directories; its `__post_init__` may raise
    ServeConfigError); `kind` is its name in `rolemrc.serve.engines.ENGINES`. An engine may also have a classmethod
    `preflight(name, options)` (ServeConfigError when its environment cannot serve, checked before the server binds
    its port) and `health()` (`supervisor.EngineState` and why; engines without it are always ok)."""

    kind: ClassVar[str]
    Options: ClassVar[type]
    capabilities: ClassVar[Capabilities]
    name: str
    running: Mapping[str, int]   # requests generating, per restraint label
    admitted: int                # requests admitted (waiting or generating), at most max_queue
    max_queue: int

    def __init__(self, name: str, options: Any, *, max_batch: int, max_queue: int) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """Refuse new requests, end waiting ones with 503, release resources."""

    async def submit(self, prompt: Prompt, params: SamplingParams, resolved: Resolved) -> Generation:
        """Admit one request (ApiError 400/429/503 when it cannot be) and return its stream."""

    def queue_depth(self) -> Mapping[str, int]:
        """Requests waiting for a slot, per restraint label."""

    def check_restraint(self, restraint: Restraint | ClientRestraint) -> None:
        """Raise if this engine cannot serve `restraint` (a Restraint, validated against the model here and only
        here; or what the client sent when the engine lacks `runtime_restraints`)."""


class LoraEngine(Engine, Protocol):
    """An engine with `lora_restraints`: it serves restraints as adapters, so it hears of the registered ones
    before `start`."""

    def register_adapters(self, restraints: Mapping[str, Restraint], inline: bool) -> None:
        """The registered restraints that fit this model (name -> Restraint), and whether inline ones may come."""

    async def add_adapter(self, name: str, restraint: Restraint) -> None:
        """Serve a restraint registered while running (it passed `check_restraint`)."""

    async def remove_adapter(self, name: str) -> None:
        """Stop serving a restraint registered while running."""
