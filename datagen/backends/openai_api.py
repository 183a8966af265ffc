"""The `openai` backend: any OpenAI-compatible chat endpoint through the official async client.

- concurrency limit (a semaphore around each request);
- transport retries with exponential backoff on 429, 5xx, timeouts and dropped connections;
  other HTTP errors (bad key, unknown model) stop the run with a clear BackendError;
- a SQLite cache keyed by the full request, so reruns and resumed runs replay earlier answers
  instead of paying for them again;
- `structured`: profiles are asked for with a JSON Schema `response_format` (constrained decoding on servers
  with structured outputs: vLLM, rolemrc serve's vLLM engine, OpenAI), so a small model cannot break the JSON;
- content attempts: a malformed reply (bad JSON, broken rule, missing answer, ...) is asked for
  again up to `max_attempts` times (attempt k is sent with `seed=k`, so a deterministic server
  can answer differently), then the item is dropped with its reason (DroppedError).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

from rolemrc.datagen.backends import BackendError, DroppedError
from rolemrc.datagen.config import BackendConfig
from rolemrc.datagen.profiles import COMPONENTS, MAX_COMPONENT_CHARS, ProfileError, profile_text, validate_profile
from rolemrc.datagen.replies import INTENTS, ReplySpec, check_reply

PROFILE_SYSTEM = (
    "You turn a one-sentence persona into a standardised role profile for role-play data. "
    "Reply with one JSON object and nothing else."
)


class ResponseCache:
    """SQLite map from request key to reply text (WAL, committed per write)."""

    def __init__(self, path: str | os.PathLike):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path))
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("CREATE TABLE IF NOT EXISTS responses (key TEXT PRIMARY KEY, text TEXT NOT NULL)")
        self.db.commit()

    @staticmethod
    def key(request: dict[str, Any]) -> str:
        return hashlib.sha256(json.dumps(request, sort_keys=True, ensure_ascii=False).encode()).hexdigest()

    def get(self, key: str) -> str | None:
        row = self.db.execute("SELECT text FROM responses WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def put(self, key: str, text: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO responses (key, text) VALUES (?, ?)", (key, text))
        self.db.commit()

    def close(self) -> None:
        self.db.close()


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


class OpenAIBackend:
    name = "openai"

    def __init__(self, config: BackendConfig, *, cache_path: str | os.PathLike | None = None):
        from openai import AsyncOpenAI

        self.config = config
        self.client = AsyncOpenAI(base_url=config.base_url, api_key=os.environ.get(config.api_key_env) or "EMPTY",
                                  max_retries=0, timeout=config.timeout_s)
        self.cache = ResponseCache(cache_path) if cache_path else None
        self.limit = asyncio.Semaphore(max(1, config.concurrency))
        self.events: Counter = Counter()

    async def complete(self, messages: list[dict[str, str]], attempt: int,
                       response_format: dict[str, Any] | None = None) -> str:
        """Reply text for one request: from the cache, or from the endpoint with transport retries."""
        import openai

        request = {"model": self.config.model, "messages": messages, "temperature": self.config.temperature,
                   "max_tokens": self.config.max_tokens, "attempt": attempt}
        extra = {"seed": attempt} if self.config.seed_requests else {}
        if response_format is not None:
            request["response_format"] = extra["response_format"] = response_format
        key = ResponseCache.key(request)
        if self.cache is not None and (hit := self.cache.get(key)) is not None:
            self.events["cache_hits"] += 1
            return hit
        retryable = (openai.RateLimitError, openai.InternalServerError, openai.APITimeoutError, openai.APIConnectionError)
        for retry in range(self.config.max_retries + 1):
            try:
                async with self.limit:
                    self.events["requests"] += 1
                    response = await self.client.chat.completions.create(
                        model=self.config.model, messages=messages, temperature=self.config.temperature,
                        max_tokens=self.config.max_tokens, **extra)
                break
            except retryable as exc:
                if retry == self.config.max_retries:
                    raise BackendError(f"{self.config.base_url}: giving up after {retry + 1} tries: {exc}") from None
                self.events["retries"] += 1
                await asyncio.sleep(self.config.backoff_s * 2 ** retry)
            except openai.APIStatusError as exc:
                raise BackendError(f"{self.config.base_url}: HTTP {exc.status_code}: {exc.message}") from None
        usage = getattr(response, "usage", None)
        self.events["completion_tokens"] += int(getattr(usage, "completion_tokens", 0) or 0)
        choices = getattr(response, "choices", None) or []
        text = choices[0].message.content if choices and choices[0].message else None
        text = text if isinstance(text, str) else ""
        if self.cache is not None:
            self.cache.put(key, text)
        return text

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

    async def aclose(self) -> None:
        await self.client.close()
        if self.cache is not None:
            self.cache.close()
