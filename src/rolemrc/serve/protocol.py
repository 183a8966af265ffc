"""OpenAI-compatible request/response schemas plus rolemrc's extensions (`restraint`, `experiment`)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"
SEED_MAX = 2**63 - 1


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(data: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data)}\n\n"


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape."""

    error: ErrorBody


class TextPart(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def turn(self) -> dict[str, str]:
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class JsonSchema(BaseModel):
    name: str = Field("response", max_length=64)
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON Schema the reply must satisfy")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON satisfying a schema (engines with
    structured outputs only)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("type 'json_schema' goes with json_schema: {name, schema}, and only it")
        return self

    def constrained(self) -> dict[str, Any] | None:
        """The OpenAI body field for an engine to enforce; None for free text."""
        return None if self.type == "text" else self.model_dump(by_alias=True, exclude_none=True)


class StreamOptions(BaseModel):
    include_usage: bool = False


def _off(value: Any) -> bool:
    return not value


# OpenAI fields accepted by the schema but not honoured: a request that sets one to anything but its
# no-op value gets a 400 naming it, never a silent drop
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "frequency_penalty": _off, "presence_penalty": _off, "logit_bias": _off, "tools": _off, "functions": _off,
    "tool_choice": lambda v: v in (None, "none"), "function_call": lambda v: v in (None, "none"),
    "best_of": lambda v: v in (None, 1),
    "suffix": _off,
}


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128, description="choices per prompt; with a seed, choice k samples with seed + k")
    stop: str | list[str] | None = Field(None)
    seed: int | None = Field(None, ge=-SEED_MAX, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=512)
    # rolemrc extensions
    restraint: str | dict[str, Any] | None = Field(
        None, description="a registered restraint name, or an inline spec {name, hook, units, factor} "
                          "(only if the server allows inline specs)")
    experiment: str | None = Field(None, description="A/B experiment id: the arm (sticky by `user`) picks model "
                                                     "and restraint, and the request is logged")
    metadata: dict[str, Any] | None = Field(None, description="kept in the A/B log (e.g. task, reference)")
    ignore_eos: bool = Field(False, description="keep generating past end-of-sequence (benchmarks)")
    # accepted, not honoured: 400 unless the no-op value (see UNSUPPORTED)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="unsupported unless 0")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="unsupported unless 0")
    logit_bias: dict[str, float] | None = Field(None, description="unsupported unless empty")

    @model_validator(mode="after")
    def _seeds(self) -> SamplingFields:
        if self.seed is not None and self.seed + self.n - 1 > SEED_MAX:
            raise ValueError(f"seed + n - 1 must be at most {SEED_MAX} (choice k samples with seed + k)")
        return self

    def stops(self) -> list[str]:
        items = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in items if s]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def refused(self) -> tuple[str, str] | None:
        """(param, why) for the first field this server refuses: set to a value it does not honour."""
        name = next((name for name, off in UNSUPPORTED.items() if name in type(self).model_fields
                     and not off(getattr(self, name))), None)
        return None if name is None else (name, f"{name!r} is not supported by this server")

    def top_logprobs_count(self) -> int | None:
        """None: no log-probabilities; k: each token's and its k most likely alternatives."""
        return None

    def echo_prompt(self) -> bool:
        return False


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = Field(False, description="each generated token's log-probability (temperature 1)")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="with logprobs: the most likely alternatives")
    tools: list[dict[str, Any]] | None = Field(None, description="unsupported unless empty")
    tool_choice: str | dict[str, Any] | None = Field(None, description="unsupported unless 'none'")
    functions: list[dict[str, Any]] | None = Field(None, description="unsupported unless empty")
    function_call: str | dict[str, Any] | None = Field(None, description="unsupported unless 'none'")
    response_format: ResponseFormat | None = Field(None, description="json_object / json_schema: constrained "
                                                                     "decoding, on engines with structured outputs")

    def refused(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().refused()

    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def prompt_shape(value: Any) -> str:
    """Which form a completion prompt takes, read from its first item, so validation tries that one alone (trying
    each form of the union in turn costs an error object per item of a large token-id list)."""
    if isinstance(value, str) or not isinstance(value, list):
        return "text"
    first = value[0] if value else ""
    return "texts" if isinstance(first, str) else "ids" if isinstance(first, int) else "id_lists"


CompletionPrompt = Annotated[Annotated[str, Tag("text")] | Annotated[list[str], Tag("texts")]
                             | Annotated[list[int], Tag("ids")] | Annotated[list[list[int]], Tag("id_lists")],
                             Discriminator(prompt_shape)]


class CompletionRequest(SamplingFields):
    prompt: CompletionPrompt = Field(
        description="a string, a list of strings, a list of token ids, or a list of token-id lists: one choice per "
                    "prompt (times n)")
    logprobs: int | None = Field(None, ge=0, le=5, description="each token's log-probability and this many "
                                                               "most likely alternatives (temperature 1)")
    echo: bool = Field(False, description="prepend the prompt (and, with logprobs, its tokens' log-probabilities)")
    best_of: int | None = Field(None, ge=1, le=20, description="unsupported unless 1")
    suffix: str | None = Field(None, description="unsupported unless empty")

    def prompts(self) -> list[str | list[int]]:
        """Each prompt the request holds: a string or a list of token ids."""
        single = isinstance(self.prompt, str) or (bool(self.prompt) and isinstance(self.prompt[0], int))
        return [self.prompt] if single else list(self.prompt)

    def top_logprobs_count(self) -> int | None:
        return self.logprobs

    def echo_prompt(self) -> bool:
        return self.echo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class TextLogprobs(BaseModel):
    """The legacy completions shape; with echo the first prompt token's entries are null."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: ChatLogprobs | None = None


class Served(BaseModel):
    """Who served a response (extension fields on every completion)."""

    restraint: str | None = None
    experiment: str | None = None
    arm: str | None = None


class ChatCompletionResponse(Served):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(Served):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: TextLogprobs | None = None


class CompletionResponse(Served):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rolemrc"
    root: str
    restraint: str | None = None
    engine: str
    lora: str | None = None   # how restraints run as LoRA (vllm engine): which ops, and where unrestrained requests go


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class RestraintCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=ID_PATTERN, description="the name requests and A/B arms use ('model+name' ids)")
    spec: dict[str, Any] = Field(description="a restraint spec (hook, units, factor; as `intervene select` writes)")


class RestraintCard(BaseModel):
    name: str
    object: Literal["restraint"] = "restraint"
    hook: str
    factor: float
    units: int = Field(description="units scaled, over all layers")
    models: list[str] = Field(description="the served models it fits")
    spec: dict[str, Any]


class RestraintList(BaseModel):
    object: Literal["list"] = "list"
    data: list[RestraintCard]


class Arm(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=ID_PATTERN)
    model: str = Field(min_length=1, max_length=256, description="a served model id (may include '+restraint')")
    restraint: str | None = Field(None, max_length=256, description="a registered restraint name")
    weight: float = Field(1.0, gt=0.0, le=1e6)


class ExperimentCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, pattern=ID_PATTERN)
    description: str = Field("", max_length=4096)
    arms: list[Arm] = Field(min_length=1, max_length=16)
    reveal_arm: bool = Field(True, description="responses and stream chunks say which arm served them (`experiment`, "
                                               "`arm`, the arm's `model` and `restraint`); false: they say none of it")

    @field_validator("arms")
    @classmethod
    def _unique(cls, arms: list[Arm]) -> list[Arm]:
        names = [a.name for a in arms]
        if len(set(names)) != len(names):
            raise ValueError("arm names must be unique")
        return arms


class Experiment(BaseModel):
    id: str
    object: Literal["experiment"] = "experiment"
    description: str
    arms: list[Arm]
    created: float
    reveal_arm: bool = True
    requests: dict[str, int] = Field(default_factory=dict, description="logged requests per arm")
