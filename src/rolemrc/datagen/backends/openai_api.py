"""The `openai` backend: any OpenAI-compatible chat endpoint through `core.openai_client.OpenAIClient`.

- the client's concurrency limit, transport retries with backoff (giving up stops the run with a clear
  BackendError) and SQLite response cache, so reruns and resumed runs replay earlier answers;
- `structured`: profiles are asked for with a JSON Schema `response_format` (constrained decoding on servers
  with structured outputs: vLLM, rolemrc serve's vLLM engine, OpenAI), so a small model cannot break the JSON;
- content attempts: a malformed reply (bad JSON, broken rule, missing answer, ...) is asked for
  again up to `max_attempts` times (attempt k is sent with `seed=k`, so a deterministic server
  can answer differently), then the item is dropped with its reason (DroppedError).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from rolemrc.core.openai_client import OpenAIClient
from rolemrc.datagen.config import BackendConfig, BackendError, DroppedError
from rolemrc.datagen.profiles import COMPONENTS, MAX_COMPONENT_CHARS, ProfileError, profile_text, validate_profile
from rolemrc.datagen.replies import INTENTS, ReplySpec, check_reply

PROFILE_SYSTEM = (
    "You turn a one-sentence persona into a standardised role profile for role-play data. "
    "Reply with one JSON object and nothing else."
)


def profile_messages(persona: str) -> list[dict[str, str]]:
    keys = ", ".join(f'"{k}" ({v.lower()})' for k, v in COMPONENTS.items())
    return [
        {"role": "system", "content": PROFILE_SYSTEM},
        {"role": "user", "content": f"Persona: {persona}\n\nReturn JSON of the form "
                                    f'{{"name": "<a fitting personal name>", "components": {{...}}}} '
                                    f"where components has exactly these string fields: {keys}."},
    ]


def profile_schema(max_tokens: int) -> dict[str, Any]:
    """`response_format` for a profile: the JSON shape `validate_profile` accepts, each component short enough
    (at a conservative 3 characters per token) that the whole object fits in `max_tokens`."""
    chars = min(MAX_COMPONENT_CHARS, max(40, (max_tokens - 100) * 3 // len(COMPONENTS)))
    text = {"type": "string", "minLength": 1, "maxLength": chars}
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "components"], "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 80},
        "components": {"type": "object", "additionalProperties": False, "required": list(COMPONENTS),
                       "properties": dict.fromkeys(COMPONENTS, text)}}}
    return {"type": "json_schema", "json_schema": {"name": "role_profile", "schema": schema}}


def reply_messages(spec: ReplySpec) -> list[dict[str, str]]:
    """System prompt with the profile and the turn's instructions, then the conversation so far."""
    lines = [profile_text(spec.profile["name"], spec.profile["components"]), "",
             f"Task for your next reply: {INTENTS[spec.intent]}"]
    if spec.passages:
        lines.append("Passages:\n" + "\n".join(f"[{i + 1}] {p}" for i, p in enumerate(spec.passages)))
    if spec.question:
        lines.append(f"Question: {spec.question}")
    if spec.answer and spec.intent in ("answer", "answer_outside", "insist_answer"):
        lines.append(f"The answer according to the passages: {spec.answer}")
    if spec.topic:
        lines.append(f"Topic: {spec.topic}")
    lines.append("You may describe actions in brackets, like (smiles)." if spec.narration
                 else "Speak only; no narration, no brackets, no asterisks.")
    if spec.rule is not None:
        lines.append(f"Formatting rule you must obey: {spec.rule.instruction}")
    lines.append("Write only the reply itself.")
    return [{"role": "system", "content": "\n".join(lines)}, *spec.history]


def parse_json_object(text: str) -> Any:
    """The first JSON object in a reply (tolerates code fences and chatter around it)."""
    match = re.search(r"\{.*\}", text, flags=re.S)
    if not match:
        raise ProfileError("no JSON object in reply")
    try:
        return json.loads(match.group(0))
    except json.JSONDecodeError:
        raise ProfileError("invalid JSON in reply") from None


class OpenAIBackend(OpenAIClient):
    """The openai backend: a `core.openai_client.OpenAIClient` configured by `config` that writes profiles and replies."""

    name = "openai"

    def __init__(self, config: BackendConfig, *, cache_path: str | os.PathLike | None = None):
        super().__init__(config.base_url, config.model, temperature=config.temperature, max_tokens=config.max_tokens,
                         concurrency=config.concurrency, max_retries=config.max_retries, backoff_s=config.backoff_s,
                         timeout_s=config.timeout_s, api_key_env=config.api_key_env, seed_requests=config.seed_requests,
                         cache_path=cache_path, error=BackendError)
        self.config = config

    async def profile(self, persona: dict[str, str]) -> tuple[str, dict[str, str]]:
        reason = "no attempt"
        for attempt in range(self.config.max_attempts):
            text = await self.complete(profile_messages(persona["persona"]), attempt,
                                       profile_schema(self.config.max_tokens) if self.config.structured else None)
            try:
                data = parse_json_object(text)
                if not isinstance(data, dict):
                    raise ProfileError("reply is not a JSON object")
                return validate_profile(data.get("name"), data.get("components"))
            except ProfileError as exc:
                reason = str(exc)
                self.events["malformed"] += 1
        raise ProfileError(reason)

    async def reply(self, spec: ReplySpec) -> str:
        reason = "no attempt"
        for attempt in range(self.config.max_attempts):
            text = (await self.complete(reply_messages(spec), attempt)).strip()
            reason = check_reply(spec, text)
            if reason is None:
                return text
            self.events["malformed"] += 1
        raise DroppedError(reason)
