"""`rolemrc bench generate`: completion tokens/s of the generation engine against HF `generate` on static batches and
against transformers' own continuous batching, in process on one loaded model, at several concurrencies.

Per concurrency `c`, `c x waves` greedy requests (ignore_eos), all queued at start:
- `engine`: `generate.engine.Engine` with `max_batch = c` (what eval and sweep run), unrestrained, under one restraint
  for every request, and under a mix of 4 (request i under restraint i % 4);
- `static`: HF `model.generate` over left-padded batches of `c` requests in arrival order; a batch runs until its
  longest request is done;
- `generate_batch`: transformers' continuous batching (the manager `model.generate_batch` runs, opened untimed per
  run, at most `c` requests per batch, each request with its own budget); a failure is recorded as its error string.

Two workloads: `fixed` (equal prompts, every request `tokens` long) and `varied` (prompt lengths and budgets drawn
with a fixed seed). Only the tokens each request asked for count, everywhere. Every variant is timed in the same run,
repeats interleaved (medians)."""

from __future__ import annotations

import gc
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from rolemrc.bench.common import interleaved, kind_restraints, make_model_dir
from rolemrc.core.errors import InputError
from rolemrc.core.modeling import ModelDirError, load_model, resolve_dtype, resolve_model
from rolemrc.generate.engine import PREFILL_TOKENS, Engine, Request
from rolemrc.generate.params import SamplingParams
from rolemrc.intervene import Restraint
from rolemrc.intervene.fit import validate

SMOLLM2 = "smollm2-135m-instruct"   # `rolemrc models pull smollm2`
# random-init GPU shapes of real models (built on the device, never saved)
SHAPES = {
    "llama-1b": {"hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True},   # Llama-3.2-1B
    "llama-8b": {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False},  # Llama-3.1-8B
}
NAMES = ("demo", "smollm2", *SHAPES)
WORKLOADS = ("fixed", "varied")
VARIANTS = ("engine", "engine_one_restraint", "engine_mix_of_kinds", "static", "generate_batch")
# (label, size, device type, concurrency, ratio or rate, at least): the targets, on the fixed workload
TARGETS = (("cpu smollm2 c=32 engine_vs_static", "smollm2", "cpu", 32, "engine_vs_static", 1.3),
           ("cpu smollm2 c=32 mix_of_kinds_vs_unrestrained", "smollm2", "cpu", 32, "mix_of_kinds_vs_unrestrained", 0.9),
           ("gpu llama-8b c=32 engine_vs_static", "llama-8b", "cuda", 32, "engine_vs_static", 1.5),
           ("gpu llama-8b c=1 engine tokens/s", "llama-8b", "cuda", 1, "engine", 100.0),
           ("gpu llama-8b c=32 mix_of_kinds_vs_unrestrained", "llama-8b", "cuda", 32, "mix_of_kinds_vs_unrestrained", 0.9))


@dataclass
class Workload:
    """Requests as token-id prompts and completion budgets."""

    prompts: list[list[int]]
    budgets: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.budgets)


def workload(kind: str, n: int, prompt_tokens: int, tokens: int, vocab: int, seed: int = 0) -> Workload:
    """`n` random-id requests: `fixed`, prompts of `prompt_tokens` and budgets of `tokens`; `varied`, prompt lengths
    uniform in [prompt_tokens / 4, 2 prompt_tokens] and budgets uniform in [tokens / 4, tokens]."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "fixed":
        lengths, budgets = [prompt_tokens] * n, [tokens] * n
    else:
        lengths = torch.randint(max(1, prompt_tokens // 4), 2 * prompt_tokens + 1, (n,), generator=gen).tolist()
        budgets = torch.randint(max(1, tokens // 4), tokens + 1, (n,), generator=gen).tolist()
    return Workload([torch.randint(10, vocab, (k,), generator=gen).tolist() for k in lengths], budgets)


def check_count(what: str, got: int, load: Workload) -> None:
    if got != load.tokens:
        raise RuntimeError(f"{what} generated {got} of the {load.tokens} requested tokens")


def engine_run(engine: Engine, load: Workload, restraints: list[Restraint | None]) -> None:
    """Every request of `load` through `engine`, all queued at once, none copying a prompt an earlier round left."""
    engine.prefixes.clear()
    done: list[int] = []

    def emit(output: Any) -> None:
        if output.finish_reason is not None:
            done.append(output.completion_tokens)

    for prompt, budget, restraint in zip(load.prompts, load.budgets, restraints):
        params = SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True)
        engine.add(Request(prompt, params, budget, emit, restraint))
    with torch.inference_mode():
        while engine.has_work():
            engine.step()
    check_count("the engine", sum(done), load)


def static_run(model: Any, pad_id: int, eos: list[int], load: Workload, rows: int) -> None:
    """HF `generate` over left-padded batches of `rows` requests; each batch runs to its longest budget."""
    from transformers import GenerationConfig

    device = model.get_input_embeddings().weight.device
    counted = 0
    for start in range(0, len(load.prompts), rows):
        prompts, budgets = load.prompts[start:start + rows], load.budgets[start:start + rows]
        width, longest = max(map(len, prompts)), max(budgets)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt):] = torch.tensor(prompt)
            mask[i, width - len(prompt):] = 1
        config = GenerationConfig(max_new_tokens=longest, min_new_tokens=longest, do_sample=False, pad_token_id=pad_id,
                                  eos_token_id=eos)
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
        if out.shape[1] - width != longest:
            raise RuntimeError(f"HF generate ran {out.shape[1] - width} of {longest} steps")
        counted += sum(budgets)
    check_count("HF generate", counted, load)


class Batching:
    """transformers' continuous batching (what `model.generate_batch` runs), guarded: its first failure is kept in
    `error` and every later run is a no-op. `session` opens the manager (untimed: it switches the model to paged
    attention until it closes, so each run opens its own); `run` times nothing itself."""

    def __init__(self, model: Any, rows: int, load: Workload, pad_id: int) -> None:
        self.model, self.rows, self.load, self.pad_id = model, rows, load, pad_id
        self.error: str | None = None
        self.manager: Any = None

    def fail(self, exc: BaseException) -> None:
        self.error = self.error or f"{type(exc).__name__}: {exc}"

    @contextmanager
    def session(self) -> Iterator[None]:
        with ExitStack() as stack:
            if self.error is None:
                try:
                    self.manager = stack.enter_context(self._open())
                except Exception as exc:   # any failure is the measurement's result
                    self.fail(exc)
            yield

    def _open(self) -> AbstractContextManager:
        """The manager's context: at most `rows` requests per batch, the engine's prefill budget, cache blocks for
        two requests per row (not a share of the free memory)."""
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        budgets = self.load.budgets
        longest = max(len(p) for p in self.load.prompts) + max(budgets)
        page = 256   # tokens per cache block, the default (`page_size` since 5.18, `block_size` before)
        config = ContinuousBatchingConfig(max_requests_per_batch=self.rows, max_batch_tokens=PREFILL_TOKENS,
                                          num_blocks=2 * self.rows * -(-longest // page) + 4)
        generation = GenerationConfig(do_sample=False, max_new_tokens=max(budgets), pad_token_id=self.pad_id,
                                      eos_token_id=-1)
        return self.model.continuous_batching_context_manager(generation_config=generation,
                                                              continuous_batching_config=config, block=True, timeout=30)

    def run(self, patience: float = 300.0) -> None:
        if self.error is not None:
            return
        try:
            self._run(patience)
        except Exception as exc:   # any failure is the measurement's result
            self.fail(exc)

    def _run(self, patience: float) -> None:
        manager = self.manager
        ids = [manager.add_request(p, max_new_tokens=b, eos_token_id=-1)
               for p, b in zip(self.load.prompts, self.load.budgets)]
        counts: dict[str, int] = {}
        last = time.perf_counter()
        while len(counts) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(result.error)
                counts[result.request_id] = len(result.generated_tokens)
                last = time.perf_counter()
            elif result is None and (not manager.is_running() or time.perf_counter() - last > patience):
                raise RuntimeError(f"stopped with {len(counts)} of {len(ids)} requests finished")
        check_count("generate_batch", sum(counts.values()), self.load)


def id_tokenizer(vocab: int) -> Any:
    """A tokenizer whose ids are the vocabulary's positions, one word `<i>` each (Llama 3's EOS and pad ids): what
    the engine needs from a tokenizer (EOS, pad, decoding) for a random-init model of a real vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab)}, unk_token="<0>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, bos_token="<128000>", eos_token="<128001>",
                                   pad_token="<128004>", unk_token="<0>")


def build_shape(name: str, device: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """A random-init model of one of SHAPES, built on `device` at `dtype`, and its id tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SHAPES[name], max_position_embeddings=8192, rope_theta=500000.0, bos_token_id=128000,
                         eos_token_id=128001, pad_token_id=128004)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval(), id_tokenizer(config.vocab_size)


def load_size(name: str, root: Path, device: str, dtype: str) -> tuple[Any, Any]:
    """(model, tokenizer) for a size name; a ModelDirError when SmolLM2 is not pulled."""
    if name in SHAPES:
        return build_shape(name, device, resolve_dtype(dtype) or torch.bfloat16)
    path = resolve_model(SMOLLM2) if name == "smollm2" else make_model_dir(name, root)
    return load_model(path, dtype=dtype, device=device)


def describe(model: Any) -> dict[str, Any]:
    c = model.config
    return {"arch": c.model_type, "layers": c.num_hidden_layers, "hidden": c.hidden_size,
            "intermediate": c.intermediate_size, "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
            "vocab": c.vocab_size, "parameters": sum(p.numel() for p in model.parameters()),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}


def measure_point(model: Any, tok: Any, requests: Workload, rows: int, restraints: list[Restraint], repeats: int,
                  device: str, tick: Callable[[], None]) -> dict[str, Any]:
    """Tokens/s of every variant on one workload at concurrency `rows`, and their ratios."""
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    n = len(requests.budgets)
    engine = Engine(model, tok, max_batch=rows)
    batching = Batching(model, rows, requests, pad_id)
    per_request = {"engine": [None] * n, "engine_one_restraint": [restraints[0]] * n,
                   "engine_mix_of_kinds": [restraints[i % 4] for i in range(n)]}

    def ticked(fn: Callable[[], None]) -> Callable[[], None]:
        return lambda: (fn(), tick())

    fns = {v: ticked(lambda rs=rs: engine_run(engine, requests, rs)) for v, rs in per_request.items()}
    fns["static"] = ticked(lambda: static_run(model, pad_id, [tok.eos_token_id], requests, rows))
    fns["generate_batch"] = ticked(batching.run)
    seconds = interleaved(fns, repeats, device, contexts={"generate_batch": batching.session})
    rate = {v: None if v == "generate_batch" and batching.error else requests.tokens / s for v, s in seconds.items()}
    unrestrained = rate["engine"]
    row: dict[str, Any] = {
        "requests": n, "completion_tokens": requests.tokens,
        "tokens_per_s": {v: None if r is None else round(r, 1) for v, r in rate.items()},
        "ratios": {"engine_vs_static": round(unrestrained / rate["static"], 3),
                   "engine_vs_generate_batch": round(unrestrained / rate["generate_batch"], 3)
                   if rate["generate_batch"] else None,
                   "one_vs_unrestrained": round(rate["engine_one_restraint"] / unrestrained, 3),
                   "mix_of_kinds_vs_unrestrained": round(rate["engine_mix_of_kinds"] / unrestrained, 3)}}
    if batching.error is not None:
        row["generate_batch_error"] = batching.error
    return row


def measure_size(model: Any, tok: Any, concurrencies: tuple[int, ...], tokens: int, prompt_tokens: int, waves: int,
                 repeats: int, device: str, tick: Callable[[], None]) -> dict[str, Any]:
    """Every workload at every concurrency on one loaded model: one restraint (a scale of 10% of the units), and a mix of
    the hooked kinds and none (`kind_restraints`: scale, patch, direction, none) row by row."""
    config = model.config
    kinds = kind_restraints(config.num_hidden_layers, config.intermediate_size, 0.1)
    restraints = [validate(r, model) for r in (*kinds.values(),)] + [None]
    workloads = {kind: {str(c): measure_point(model, tok, workload(kind, c * waves, prompt_tokens, tokens,
                                                                   config.vocab_size), c, restraints, repeats, device,
                                              tick)
                        for c in concurrencies} for kind in WORKLOADS}
    return {"model": describe(model),
            "restraints": {"count": len(restraints), "hook": restraints[0].hook, "factor": restraints[0].factor,
                           "units_per_layer": len(restraints[0].units[0])},
            "workloads": workloads}


def meets_targets(sizes: dict[str, Any], device_type: str) -> dict[str, bool | None]:
    """Each target met or not on the fixed workload; None where this run did not measure it."""
    met: dict[str, bool | None] = {}
    for label, size, where, c, key, least in TARGETS:
        row = sizes.get(size, {}).get("workloads", {}).get("fixed", {}).get(str(c))
        value = None if row is None or where != device_type else (
            row["tokens_per_s"][key] if key in row["tokens_per_s"] else row["ratios"][key])
        met[label] = None if value is None else value >= least
    return met


def run(sizes: tuple[str, ...] = ("demo",), concurrencies: tuple[int, ...] = (1, 8, 32), tokens: int | None = None,
        waves: int = 2, repeats: int | None = None, prompt_tokens: int = 64, device: str = "cpu",
        dtype: str = "auto") -> dict[str, Any]:
    """The benchmark over `sizes` (NAMES); `tokens` per request at most (default 64 on CUDA, 32 elsewhere);
    `repeats` timed rounds after the warm-up (default 1 on CUDA, where both GPU shapes must fit in minutes, else 3)."""
    unknown = [s for s in sizes if s not in NAMES]
    if unknown or not sizes:
        raise InputError(f"--size: unknown size(s) {unknown}; choose from {', '.join(NAMES)}")
    device_type = torch.device(device).type
    if device_type != "cuda" and any(s in SHAPES for s in sizes):
        raise InputError(f"--size {', '.join(s for s in sizes if s in SHAPES)}: GPU shapes; run them with a CUDA "
                         f"device (this run's is {device})")
    tokens = tokens if tokens is not None else 64 if device_type == "cuda" else 32
    repeats = repeats if repeats is not None else 1 if device_type == "cuda" else 3
    if min(concurrencies, default=0) < 1 or waves < 1 or repeats < 1 or prompt_tokens < 1 or tokens < 1:
        raise InputError("--concurrency, --waves, --repeats, --prompt-tokens and --tokens must be at least 1")
    bar = tqdm(total=len(sizes) * len(WORKLOADS) * len(concurrencies) * len(VARIANTS) * (repeats + 1),
               desc="measurements", unit="run")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in sizes:
            bar.set_postfix_str(name)
            try:
                model, tok = load_size(name, Path(tmp), device, dtype)
            except ModelDirError as exc:
                results[name] = {"skipped": f"{exc} (rolemrc models pull smollm2)"}
                bar.update(len(WORKLOADS) * len(concurrencies) * len(VARIANTS) * (repeats + 1))
                continue
            results[name] = measure_size(model, tok, concurrencies, tokens, prompt_tokens, waves, repeats, device,
                                         bar.update)
            del model, tok
            gc.collect()
            if device_type == "cuda":
                torch.cuda.empty_cache()
    bar.close()
    import transformers

    return {"benchmark": "generate", "torch": torch.__version__, "transformers": transformers.__version__,
            "device": device, "device_name": (torch.cuda.get_device_name(device) if device_type == "cuda"
                                              else platform.processor() or platform.machine()),
            "dtype": dtype, "torch_threads": torch.get_num_threads(), "concurrency": list(concurrencies),
            "max_tokens": tokens, "prompt_tokens": prompt_tokens, "waves": waves, "repeats": repeats,
            "requests_per_concurrency": "concurrency x waves, all queued at start; greedy, ignore_eos",
            "workloads": {"fixed": f"prompts of {prompt_tokens} tokens, every request {tokens} tokens",
                          "varied": f"prompts of {max(1, prompt_tokens // 4)}..{2 * prompt_tokens} tokens, "
                                    f"{max(1, tokens // 4)}..{tokens} tokens per request (seed 0); a static batch "
                                    "runs to its longest request, only requested tokens count"},
            "sizes": results,
            "targets": {label: f"{'>=' if key != 'engine' else 'tokens/s >='} {least}"
                        for label, _, _, _, key, least in TARGETS},
            "meets_targets": meets_targets(results, device_type)}
