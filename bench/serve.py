"""`rolemrc bench serve`: generation throughput (completion tokens/s) of the serve engine at several
concurrencies: batched engine vs naive sequential `generate`, runtime-restrained vs unrestrained,
baked vs unrestrained. Every ratio is measured side by side in one run (medians of repeats)."""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rolemrc.bench.common import SIZES, make_model_dir
from rolemrc.core.chat import render_chat
from rolemrc.intervene import Restraint, bake
from rolemrc.serve.engines.base import Prompt, Resolved, SamplingParams
from rolemrc.serve.engines.transformers import TransformersEngine, TransformersOptions


def prompts(n: int, words: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": " ".join(f"sample text {i + j} for the benchmark" for j in range(words // 5))}]
            for i in range(n)]


def restraint_for(width: int, layers: int) -> Restraint:
    """A quarter of each layer's MLP units at factor 0.5 (runtime hooks on every layer)."""
    return Restraint(name="bench", hook="mlp.act", factor=0.5, units={i: list(range(0, width, 4)) for i in range(layers)})


async def _engine_run(engine: TransformersEngine, chats: list, concurrency: int, tokens: int, resolved: Resolved) -> float:
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def one(chat):
        nonlocal done
        async with sem:
            gen = await engine.submit(Prompt(messages=chat), SamplingParams(max_tokens=tokens, temperature=0,
                                                                             ignore_eos=True), resolved)
            async with gen:
                await gen.text()
            done += gen.final.completion_tokens

    start = time.perf_counter()
    await asyncio.gather(*(one(c) for c in chats))
    return done / (time.perf_counter() - start)


def engine_rate(model_dir: Path, chats: list, concurrency: int, tokens: int, restraint: Restraint | None,
                max_batch: int, device: str = "cpu") -> float:
    async def go() -> float:
        engine = TransformersEngine("bench", TransformersOptions(path=str(model_dir), device=device), max_batch=max_batch,
                                    max_queue=len(chats) + 1, default_max_tokens=tokens)
        await engine.start()
        try:
            resolved = Resolved(restraint, "bench", "name:bench", "bench") if restraint else Resolved()
            await _engine_run(engine, chats[:concurrency], concurrency, tokens, resolved)   # warm-up
            return await _engine_run(engine, chats, concurrency, tokens, resolved)
        finally:
            await engine.stop()
    return asyncio.run(go())


def naive_rate(model_dir: Path, chats: list, tokens: int, device: str = "cpu") -> float:
    """One request at a time through `model.generate` (what a server without batching does)."""
    from rolemrc.core.modeling import load_model

    model, tok = load_model(model_dir, device=device)
    start, done = time.perf_counter(), 0
    with torch.inference_mode():
        for k, chat in enumerate([chats[0], *chats]):   # the first call warms up
            if k == 1:
                start, done = time.perf_counter(), 0
            ids = tok(render_chat(tok, chat), return_tensors="pt", add_special_tokens=False).to(model.device)
            out = model.generate(**ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            done += out.shape[1] - ids["input_ids"].shape[1]
    return done / (time.perf_counter() - start)


def run(concurrencies: tuple[int, ...] = (1, 8, 32), tokens: int = 32, waves: int = 2, repeats: int = 3,
        size: str = "demo", words: int = 40, device: str = "cpu") -> dict[str, Any]:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(size, Path(tmp))
        spec = SIZES[size]
        restraint = restraint_for(spec["intermediate"], spec["layers"])
        baked_dir = Path(tmp) / "baked"
        bake(model_dir, restraint, baked_dir)
        results = {}
        for c in concurrencies:
            chats = prompts(c * waves, words)
            rates: dict[str, list[float]] = {"naive": [], "batched": [], "restrained": [], "baked": []}
            for _ in range(repeats):   # interleaved, so drift hits every variant alike
                rates["naive"].append(naive_rate(model_dir, chats[:max(c, 4)], tokens, device))
                rates["batched"].append(engine_rate(model_dir, chats, c, tokens, None, max(c, 1), device))
                rates["restrained"].append(engine_rate(model_dir, chats, c, tokens, restraint, max(c, 1), device))
                rates["baked"].append(engine_rate(baked_dir, chats, c, tokens, None, max(c, 1), device))
            med = {k: statistics.median(v) for k, v in rates.items()}
            results[str(c)] = {"tokens_per_s": {k: round(v, 1) for k, v in med.items()},
                               "batched_vs_naive": round(med["batched"] / med["naive"], 3),
                               "restrained_vs_unrestrained": round(med["restrained"] / med["batched"], 3),
                               "baked_vs_unrestrained": round(med["baked"] / med["batched"], 3)}
    return {"benchmark": "serve", "model": {"arch": "llama", **SIZES[size]}, "completion_tokens": tokens,
            "requests_per_concurrency": "concurrency x waves", "waves": waves, "repeats": repeats,
            "restraint_units": restraint.num_units, "torch_threads": torch.get_num_threads(), "device": device,
            "results": results,
            "targets": {"batched_vs_naive": ">= 3 at 8+", "restrained_vs_unrestrained": ">= 0.95",
                        "baked_vs_unrestrained": "~1.0"}}
