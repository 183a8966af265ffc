"""Judges over scored items, registered by name: `rules` (offline, exact verifiers) and `openai` (any
compatible endpoint). A judge is one function decorated with `@register_judge(name)`; JudgeConfig
validation, the CLI's --judge help and the run summary read the registry. `judge` fails damaged replies
(eval.damage) itself, so no judge sees them.

The openai judge goes through `core.openai_client.OpenAIClient` (concurrency limit, retries with backoff on
429/5xx/timeouts, SQLite cache keyed by the full request, seed 0), so reruns replay cached verdicts.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from rolemrc.core.errors import InputError
from rolemrc.core.records import prompt_turns
from rolemrc.core.registry import Registry
from rolemrc.core.taxonomy import Aspect, judge_aspects_for_task
from rolemrc.eval.verdicts import UNPARSEABLE, Verdict, parse_verdict

Call = tuple[dict[str, Any], Aspect]


@dataclass
class JudgeConfig:
    """Which judge scores the items (a name in `JUDGES`); model, base_url and the request fields apply to
    endpoint judges (`openai`) only."""

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
        if JUDGES.get(self.name).endpoint and not (self.model and self.base_url):
            raise InputError(f"the {self.name} judge needs a model and a base URL (--judge-model, --judge-base-url)")


JudgeFn = Callable[[list[Call], JudgeConfig, bool], list[Verdict]]


@dataclass(frozen=True)
class Judge:
    """A registered judge: `fn(calls, config, progress)` -> one Verdict per (item, aspect) call."""

    fn: JudgeFn
    endpoint: bool   # needs JudgeConfig.model and base_url; the run summary records them
    doc: str         # first docstring line of fn, for the run summary


JUDGES: Registry[Judge] = Registry("judge")


def register_judge(name: str, *, endpoint: bool = False) -> Callable[[JudgeFn], JudgeFn]:
    """Decorator registering `fn(calls, config, progress) -> list[Verdict]` as judge `name`; `endpoint`:
    it calls a model at JudgeConfig.base_url, so it needs JudgeConfig.model and base_url."""
    def add(fn: JudgeFn) -> JudgeFn:
        JUDGES.register(name)(Judge(fn, endpoint, (inspect.getdoc(fn) or "").split("\n")[0]))
        return fn
    return add


def judge_info(config: JudgeConfig) -> dict[str, Any]:
    """What the run summary records about the judge."""
    entry = JUDGES.get(config.name)
    info = {"name": config.name, "doc": entry.doc}
    if entry.endpoint:
        info |= {"model": config.model, "base_url": config.base_url, "temperature": config.temperature}
    return info


def judge_calls(items: list[dict[str, Any]]) -> list[Call]:
    """(item, aspect) for every judge call the items receive (docs/ARCHITECTURE.md "Taxonomy")."""
    return [(item, aspect) for item in items for aspect in judge_aspects_for_task(item.get("task") or "")]


def judge(items: list[dict[str, Any]], config: JudgeConfig | None = None, *, progress: bool = False) -> list[Verdict]:
    """Verdicts for every judge call of `items` (records with `id`, `task`, `question`, `reference`, `response`).

    A damaged reply (eval.damage: empty, degenerate, wrong language) scores 0 on every aspect, the damage as the
    reason, whichever the judge: the judge is asked about the other calls only."""
    from rolemrc.eval.damage import damaged_verdict, item_damage  # rule_parse's regexes: on first use, not in --help

    config = config or JudgeConfig()
    calls = judge_calls(items)
    found: dict[int, Any] = {}   # id(item) -> its Damage or None
    for item, _ in calls:
        if id(item) not in found:   # once per item
            found[id(item)] = item_damage(item)
    intact = iter(JUDGES.get(config.name).fn([c for c in calls if found[id(c[0])] is None], config, progress))
    return [next(intact) if (damage := found[id(item)]) is None else damaged_verdict(item, aspect, damage)
            for item, aspect in calls]


@register_judge("rules")
def rules_judge(calls: list[Call], config: JudgeConfig, progress: bool) -> list[Verdict]:
    """Deterministic verifiers, offline; see rolemrc.eval.rules for what each aspect can judge."""
    from rolemrc.eval.rules import judge_item

    return [judge_item(item, aspect) for item, aspect in tqdm(calls, desc="judge (rules)", disable=not progress)]


@register_judge("openai", endpoint=True)
def openai_judge(calls: list[Call], config: JudgeConfig, progress: bool) -> list[Verdict]:
    """An OpenAI-compatible chat endpoint asked for a 0/1 verdict per aspect (eval.prompts)."""
    return run_sync(_judge_openai(calls, config, progress))


async def _judge_openai(calls: list[Call], config: JudgeConfig, progress: bool) -> list[Verdict]:
    from rolemrc.core.openai_client import OpenAIClient
    from rolemrc.eval.prompts import judge_messages

    client = OpenAIClient(config.base_url, config.model, temperature=config.temperature, max_tokens=config.max_tokens,
                          concurrency=config.concurrency, max_retries=config.max_retries, backoff_s=config.backoff_s,
                          timeout_s=config.timeout_s, api_key_env=config.api_key_env, cache_path=config.cache)
    bar = tqdm(total=len(calls), desc=f"judge ({config.model})", disable=not progress)

    async def one(item: dict, aspect: Aspect) -> Verdict:
        messages = judge_messages(aspect, prompt_turns(item, where=f"item {item['id']!r}"), str(item.get("reference") or ""),
                                  str(item.get("response") or ""))
        raw = await client.complete(messages, attempt=0)
        bar.update()
        score = parse_verdict(raw)
        if score is None:
            return Verdict.make(item["id"], item["task"], aspect, None, UNPARSEABLE, "no single 0/1 verdict", raw)
        return Verdict.make(item["id"], item["task"], aspect, score, raw=raw)

    try:
        return list(await asyncio.gather(*(one(item, aspect) for item, aspect in calls)))
    finally:
        bar.close()
        await client.aclose()


def run_sync(coro):
    """Run a coroutine to completion, also from code that already runs an event loop (a server, Jupyter)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
