"""Pieces the benchmarks share: model sizes, a saved random-init Llama, random cases, restraints, timing."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

from rolemrc.core.errors import InputError
from rolemrc.core.tiny import build_model, train_tokenizer
from rolemrc.intervene import Restraint
from rolemrc.probe.cases import Cases

SIZES = {
    "demo": {"hidden": 192, "layers": 4, "intermediate": 512, "heads": 3},  # the embedded default (tiny profile)
    "medium": {"hidden": 256, "layers": 4, "intermediate": 688, "heads": 4},  # the earlier default the issues name
    "large": {"hidden": 1024, "layers": 8, "intermediate": 2816, "heads": 16},
}


def make_model_dir(size: str, root: Path) -> Path:
    """A random-init Llama of the given size, saved with a small tokenizer."""
    if size not in SIZES:
        raise ValueError(f"unknown benchmark size {size!r}; known: {', '.join(SIZES)}")
    out = root / size
    tok = train_tokenizer([f"sample text {i} for the benchmark tokenizer" for i in range(50)], vocab_size=300)
    model = build_model("llama", tok, seed=0, **SIZES[size])
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def random_cases(n: int, length: int, vocab: int, seed: int = 0) -> Cases:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab, (n, length), generator=gen).tolist()
    membership = torch.ones(n, 1)
    return Cases(ids, membership, ["all"], 0, "bench", torch.arange(n))


def bench_restraints(layers: int, intermediate: int, units: int | None = None, n: int = 4,
                     seed: int = 0) -> list[Restraint]:
    """`n` restraints silencing `units` random MLP units per layer (default 10%; factor 0: outputs change)."""
    rng = random.Random(seed)
    k = units or max(1, round(intermediate * 0.1))
    if not 0 < k <= intermediate:
        raise InputError(f"--units {k}: choose 1..{intermediate} (the model's MLP width)")
    return [Restraint(name=f"r{j}", hook="mlp.act", factor=0.0,
                      units={layer: sorted(rng.sample(range(intermediate), k)) for layer in range(layers)})
            for j in range(n)]


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, device: torch.device | str = "cpu",
                contexts: dict[str, Callable[[], AbstractContextManager]] | None = None) -> dict[str, float]:
    """Median wall time per function after one untimed call each, calls interleaved round-robin so drift and noise
    hit all alike, each round starting one function later (what a call leaves behind lands on each in turn); a
    function named in `contexts` runs inside a fresh context from its factory, entered and left untimed (its setup)."""
    contexts = contexts or {}
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats + 1):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            with contexts.get(name, nullcontext)():
                sync(device)
                start = time.perf_counter()
                fns[name]()
                sync(device)
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts[1:]) for name, ts in times.items()}
