"""The offline API: prompts in, completions out (like vLLM's `LLM.generate`), on the engine, in the caller's
thread, with a progress bar."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from rolemrc.generate.engine import Engine, Request
from rolemrc.generate.params import Completion, Output, SamplingParams
from rolemrc.intervene.spec import Restraint


def generate(model: Any, tokenizer: Any, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams],
             restraints: Sequence[Restraint | None] | None = None, *, max_batch: int = 32, progress: bool = True,
             desc: str = "generate") -> list[Completion]:
    """Completions of `prompts` (token ids), prompt i under `params[i]` (or one SamplingParams for all; max_tokens
    is required) and `restraints[i]` (validated against the model already; rows with different restraints share
    every forward)."""
    params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    restraints = list(restraints) if restraints is not None else [None] * len(prompts)
    engine = Engine(model, tokenizer, max_batch=max_batch)
    ends = set(engine.eos.tolist())
    texts: list[list[str]] = [[] for _ in prompts]
    logprobs: list[list] = [[] for _ in prompts]
    results: list[Completion | None] = [None] * len(prompts)
    bar = tqdm(total=len(prompts), desc=desc, disable=not progress)
    requests = []

    def collector(i: int):
        def emit(output: Output) -> None:
            texts[i].append(output.text)
            logprobs[i].extend(output.logprobs)
            if output.finish_reason is not None:
                request = requests[i]
                text = "".join(texts[i]) if request.stream else tokenizer.decode(
                    [t for t in request.out if t not in ends], skip_special_tokens=True, clean_up_tokenization_spaces=False)
                results[i] = Completion(request.out, text, output.finish_reason, len(request.prompt), logprobs[i],
                                        time.perf_counter() - request.admitted)
                bar.update()
        return emit

    for i, (prompt, p, r) in enumerate(zip(prompts, params, restraints)):
        if p.max_tokens is None:
            raise ValueError("offline generation needs max_tokens")
        requests.append(Request(list(prompt), p, p.max_tokens, collector(i), r, text=False))
        engine.add(requests[-1])
    try:
        with torch.inference_mode():
            while engine.has_work():
                engine.step()
    finally:
        bar.close()
    return results
