"""Run a judge over scored items: `rules` (offline, exact verifiers) or `openai` (any compatible endpoint).

The openai judge goes through the datagen OpenAI backend (concurrency limit, retries with backoff on
429/5xx/timeouts, SQLite cache keyed by the full request), so reruns replay cached verdicts.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from rolemrc.core.records import prompt_turns
from rolemrc.core.taxonomy import Aspect, judge_aspects_for_task
from rolemrc.eval.verdicts import UNPARSEABLE, Verdict, parse_verdict

JUDGES = ("rules", "openai")


@dataclass
class JudgeConfig:
    """Which judge scores the items; the openai fields apply to `name="openai"` only."""

    name: str = "rules"
    model: str | None = None
    base_url: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    temperature: float = 0.0
    max_tokens: int = 256
    concurrency: int = 8
    max_retries: int = 4
    timeout_s: float = 60.0
    backoff_s: float = 0.5
    cache: Path | None = None        # SQLite file; default <run dir>/judge_cache.sqlite when saving a run

    def __post_init__(self) -> None:
        if self.name not in JUDGES:
            raise ValueError(f"unknown judge {self.name!r}; choose one of {JUDGES}")
        if self.name == "openai" and not (self.model and self.base_url):
            raise ValueError("the openai judge needs a model and a base URL (--judge-model, --judge-base-url)")


def judge_calls(items: list[dict[str, Any]]) -> list[tuple[dict[str, Any], Aspect]]:
    """(item, aspect) for every judge call the items receive (DESIGN.md task -> aspects)."""
    return [(item, aspect) for item in items for aspect in judge_aspects_for_task(item.get("task") or "")]


def judge(items: list[dict[str, Any]], config: JudgeConfig | None = None, *, progress: bool = False) -> list[Verdict]:
    """Verdicts for every judge call of `items` (records with `id`, `task`, `question`, `reference`, `response`)."""
    config = config or JudgeConfig()
    calls = judge_calls(items)
    if config.name == "rules":
        from rolemrc.eval.rules import judge_item

        return [judge_item(item, aspect) for item, aspect in tqdm(calls, desc="judge (rules)", disable=not progress)]
    return run_sync(_judge_openai(calls, config, progress))


async def _judge_openai(calls: list[tuple[dict, Aspect]], config: JudgeConfig, progress: bool) -> list[Verdict]:
    from rolemrc.datagen.backends.openai_api import OpenAIBackend
    from rolemrc.datagen.config import BackendConfig
    from rolemrc.eval.prompts import judge_messages

    backend = OpenAIBackend(BackendConfig(
        name="openai", base_url=config.base_url, model=config.model, api_key_env=config.api_key_env,
        concurrency=config.concurrency, max_retries=config.max_retries, timeout_s=config.timeout_s,
        temperature=config.temperature, max_tokens=config.max_tokens, backoff_s=config.backoff_s), cache_path=config.cache)
    bar = tqdm(total=len(calls), desc=f"judge ({config.model})", disable=not progress)

    async def one(item: dict, aspect: Aspect) -> Verdict:
        messages = judge_messages(aspect, prompt_turns(item, where=f"item {item['id']!r}"), str(item.get("reference") or ""),
                                  str(item.get("response") or ""))
        raw = await backend.complete(messages, attempt=0)
        bar.update()
        score = parse_verdict(raw)
        if score is None:
            return Verdict.make(item["id"], item["task"], aspect, None, UNPARSEABLE, "no single 0/1 verdict", raw)
        return Verdict.make(item["id"], item["task"], aspect, score, raw=raw)

    try:
        return list(await asyncio.gather(*(one(item, aspect) for item, aspect in calls)))
    finally:
        bar.close()
        await backend.aclose()


def run_sync(coro):
    """Run a coroutine to completion, also from code that already runs an event loop (a server, Jupyter)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
