"""Pieces the benchmarks share: model sizes, a saved random-init Llama, random cases, restraints, timing."""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def kind_restraints(layers: int, width: int, share: float) -> dict[str, Restraint]:
    """A restraint of each hooked kind on every layer at mlp.act: scale and patch of `share` of the units, and a
    random direction."""
    gen = torch.Generator().manual_seed(0)
    k = max(1, int(share * width))
    scale = Restraint(name="scale", hook="mlp.act", factor=0.5,
                      units={layer: sorted(torch.randperm(width, generator=gen)[:k].tolist()) for layer in range(layers)})
    patch = Restraint(name="patch", hook="mlp.act", kind="patch", units=scale.units,
                      values={layer: [0.1] * len(units) for layer, units in scale.units.items()})
    direction = Restraint(name="direction", hook="mlp.act", kind="direction",
                          directions={layer: torch.randn(width, generator=gen).tolist() for layer in range(layers)})
    return {"scale": scale, "patch": patch, "direction": direction}


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


NOISE = 0.10   # a ratio whose rounds spread (max - min) by more than this share of its median is noise, not a result
MIN_SECONDS = 1.0   # each timed run lasts at least this long (a function too quick for it is called several times)


@dataclass
class Timings:
    """Seconds per call of each function, one value per timed round (`interleaved`)."""

    rounds: dict[str, list[float]]
    calls: dict[str, int]   # calls per timed run (enough for MIN_SECONDS)

    def __getitem__(self, name: str) -> float:
        """The median seconds per call."""
        return statistics.median(self.rounds[name])

    def items(self) -> list[tuple[str, float]]:
        return [(name, self[name]) for name in self.rounds]

    def ratio(self, a: str, b: str, digits: int = 3) -> dict[str, Any]:
        """a's time over b's, round by round (the rounds interleave them): the median with its min-max, and `noise`
        when the rounds disagree by more than NOISE of the median (such a ratio is not a result)."""
        per_round = [x / y for x, y in zip(self.rounds[a], self.rounds[b])]
        median = statistics.median(per_round)
        spread = (max(per_round) - min(per_round)) / median
        return {"median": round(median, digits), "min": round(min(per_round), digits),
                "max": round(max(per_round), digits), "noise": spread > NOISE}


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, device: torch.device | str = "cpu",
                contexts: dict[str, Callable[[], AbstractContextManager]] | None = None,
                min_seconds: float = MIN_SECONDS) -> Timings:
    """Wall time per call of each function over `repeats` rounds after one untimed call each (which also sizes a
    timed run: a function quicker than `min_seconds` is called enough times per run to last that long). Calls are
    interleaved round-robin so drift and noise hit all alike, each round starting one function later (what a call
    leaves behind lands on each in turn); a function named in `contexts` runs inside a fresh context from its
    factory, entered and left untimed (its setup)."""
    contexts = contexts or {}
    names = list(fns)
    calls = dict.fromkeys(names, 1)
    rounds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats + 1):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            with contexts.get(name, nullcontext)():
                sync(device)
                start = time.perf_counter()
                for _ in range(calls[name]):
                    fns[name]()
                sync(device)
                elapsed = time.perf_counter() - start
            if r == 0:   # the warm-up sizes the timed runs
                calls[name] = max(1, math.ceil(min_seconds / max(elapsed, 1e-6)))
            else:
                rounds[name].append(elapsed / calls[name])
    return Timings(rounds, calls)
