"""The unit selectors, in one table (`SELECTORS`, like eval's metrics): what each reads, how its scores and q-values
come out of that input, how it is labelled and plotted, and the token policy it needs.

Every consumer reads this table: `intervene select` and sweeps (`intervene.select`), the explorer page
(`probe.explorer`), the diff's selection stability (`probe.diff`) and the calibration (`organism.calibration_config`).
Adding a selector is one `@selector(...)` function over the loaded input (a `DiffResult` or an `Attribution`).
Torch-free at import: the CLIs' help lists the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from rolemrc.core.registry import Registry
from rolemrc.probe.options import Tokens

if TYPE_CHECKING:
    import torch

Reads = Literal["diff", "attribution"]   # the input a selector reads (also a restraint source's key for that file)
Plots = Literal["frequency", "mean activation"]   # what the explorer's scatter draws: the diff's freq or mean, A vs B
CalibrationInput = Literal["last", "all", "attribution"]   # the calibration's inputs: diffs by token policy, attribution


@dataclass(frozen=True)
class View:
    """One dimension of a selector's input as the selector reads it."""

    score: torch.Tensor          # [layers, width] signed: direction by its sign, ranked by |score|
    q: torch.Tensor | None       # BH q per unit (None: the input has no test here)
    no_q: str = ""               # why there are no q-values


ViewFn = Callable[[Any, str], View]   # (loaded input: DiffResult | Attribution, dimension present in it) -> View


@dataclass(frozen=True)
class Selector:
    """A registered selector and everything its consumers need to know about it."""

    name: str
    view: ViewFn
    reads: Reads
    tokens: Tokens | None          # the probe files' token policy the diff must have (None: any)
    calibrated_on: CalibrationInput   # the input the calibration feeds it
    label: str                     # what its score is (the explorer's axis)
    plots: Plots
    description: str
    ranks: str                     # how it ranks

    def reads_diff_of(self, tokens: str) -> bool:
        """Whether it reads a diff of probe files made with this token policy."""
        return self.reads == "diff" and self.tokens in (None, tokens)


SELECTORS: Registry[Selector] = Registry("selector")


def selector(name: str, *, reads: Reads, calibrated_on: CalibrationInput, label: str, plots: Plots, description: str,
             ranks: str, tokens: Tokens | None = None) -> Callable[[ViewFn], ViewFn]:
    """Decorator registering `fn(loaded input, dimension) -> View` as selector `name`."""
    def add(fn: ViewFn) -> ViewFn:
        SELECTORS.register(name)(Selector(name, fn, reads, tokens, calibrated_on, label, plots, description, ranks))
        return fn
    return add


def table() -> list[Selector]:
    """Every selector, in registration order."""
    return [SELECTORS.get(n) for n in SELECTORS.names()]


def readers(reads: Reads) -> list[str]:
    """The selectors that read this kind of input."""
    return [s.name for s in table() if s.reads == reads]


def for_tokens(tokens: str) -> list[str]:
    """The selectors that read a diff of probe files made with this token policy and need exactly it."""
    return [s.name for s in table() if s.reads == "diff" and s.tokens == tokens]


def selectors_help() -> str:
    """One line per selector: name, what it reads, how it ranks (for `intervene select --help`)."""
    return "; ".join(f"{s.name}: {s.description} (input: {s.reads}"
                     + (f", tokens={s.tokens}" if s.tokens else "") + f"; rank: {s.ranks})" for s in table())


def _frequency(result: Any, dimension: str) -> View:
    return View(result.delta[dimension], result.qvalue[dimension] if result.tested else None, f"test: {result.test}")


FREQUENCY: dict[str, Any] = {"reads": "diff", "label": "Δ frequency (freq B − freq A)", "plots": "frequency",
                             "ranks": "|freq_b - freq_a|, then the diff's q"}
selector("frequency", tokens="last", calibrated_on="last", **FREQUENCY,
         description="the paper's: change in top-fraction frequency at the last prompt token")(_frequency)
selector("frequency-all", tokens="all", calibrated_on="all", **FREQUENCY,
         description="the same over every prompt token (tokens=all probe files)")(_frequency)


@selector("standardized", reads="diff", calibrated_on="all", label="effect size (mean change / pooled SD)",
          plots="mean activation", ranks="|effect|, then the effect test's q",
          description="mean activation change over the pooled per-unit SD (the diff's effect)")
def standardized(result: Any, dimension: str) -> View:
    return View(result.effect[dimension], result.effect_q[dimension] if result.effect_tested else None,
                f"effect test: {result.effect_test}")


@selector("attribution", reads="attribution", calibrated_on="attribution", label="attribution (mean score per pair)",
          plots="mean activation", ranks="mean score per pair, no q",
          description="DPO preference-margin gradient times the SFT -> DPO activation change, over preference pairs")
def attribution(loaded: Any, dimension: str) -> View:
    return View(loaded.scores[dimension], None, "attribution scores carry no test")
