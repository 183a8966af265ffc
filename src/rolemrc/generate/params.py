"""What a generation request asks for and what it gets back: a `Request` with its `SamplingParams` in, `TokenLogprob`s
and an `Output` per step out, a `Completion` at the end (offline). No torch: a server validates its config with these."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from rolemrc.generate.sampling import TextStream
    from rolemrc.intervene.spec import Restraint


@dataclass
class SamplingParams:
    """Per-request decoding settings; temperature 0 means greedy."""

    max_tokens: int | None = None
    fit_to_context: bool = False    # max_tokens is a default: lowered to the room the prompt leaves in the context
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None     # None: none; k: each token's log-probability and its k most likely alternatives
    echo: bool = False              # the output starts with the prompt's text (completions)
    prompt_logprobs: bool = False   # also the prompt tokens' (from the prefill; the first token's is None)
    response_format: dict[str, Any] | None = None   # OpenAI's json_object / json_schema (structured outputs)


@dataclass
class TokenLogprob:
    """One token's log-probability and the `top` alternatives (most likely first), as (text, logprob)."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]]


@dataclass
class Output:
    """What one engine step gives a request: new text (held back while it may still become a stop string or an
    unfinished character), the log-probabilities of the tokens it came from, and, on its last step, why it ended
    (stop | length | cancelled | error: its logits were not finite | out_of_memory: the cache could not grow to
    admit it) and how many tokens it generated (a final EOS counts, as in vLLM)."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0


@dataclass
class Completion:
    """An offline request's result: the generated ids (a final EOS included), their text (special tokens skipped;
    up to a stop string), why it ended, its log-probabilities when asked, and the seconds from admission to end."""

    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    logprobs: list[TokenLogprob]
    latency: float


@dataclass(eq=False)
class Request:
    """One request: its prompt ids, settings, token budget and restraint (validated against the model already).
    `emit` receives its `Output`s on the engine's thread; `cancelled` is polled every step."""

    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    emit: Callable[[Output], None]
    restraint: Restraint | None = None
    cancelled: Callable[[], bool] = lambda: False
    text: bool = True   # emit text as it comes (stop strings need it); False: ids only, the caller decodes
    slot: int = -1
    out: list[int] = field(default_factory=list)
    pending: list[TokenLogprob] = field(default_factory=list)   # log-probabilities of tokens whose text is held
    stream: TextStream | None = None
    generator: torch.Generator | None = None
    admitted: float = 0.0   # perf_counter when its prefill began
    hashes: list[int] | None = None   # its prompt's blocks (prefix.block_hashes)
