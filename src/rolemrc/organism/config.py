"""What a known-answer organism is built from: the SFT model, the data, the DPO run and the held-out eval."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rolemrc.core.errors import RolemrcError
from rolemrc.train.config import TRAIN_DTYPE_HELP, check_train_dtype

# kind -> the dimension its DPO pairs change (pairs.py says how); the null changes none
PLANTED_DIMENSION: dict[str, str | None] = {"narration": "role_style", "refusal": "knowledge_boundary", "null": None,
                                            "units": "role_style"}
KINDS = tuple(PLANTED_DIMENSION)
PLANTED_DIMENSIONS = tuple(dict.fromkeys(d for d in PLANTED_DIMENSION.values() if d))
# kind -> the dimensions the rules judge reads its planted behaviour on besides its own (eval/rules.py): a refusal is
# what multi_turn's must-keep-refusing cases and prioritized's forbidden questions pass on, so they move with it by
# the judge's construction; an organism's target reports them and does not hold them to the SFT model's CI
COUPLED: dict[str, tuple[str, ...]] = {"refusal": ("multi_turn", "prioritized")}
NULL_OF = "narration"   # the kind whose pairs the null swaps at random
NULL = "null"   # the organism that plants nothing
KNOWN = "units"   # the organism whose DPO update reaches the model only through known MLP units (known.py)
PAIRS_OF = {NULL: NULL_OF, KNOWN: "narration"}   # kinds that train on another kind's pairs (the null swaps them)


# DPO learning rates by default (docs/calibration.md, "The quick organisms above had collapsed" and the trials after
# it): on SmolLM2 at 16 steps plain DPO at 5e-4 collapsed every kind into loops or bare stage directions. With the SFT
# term (sft_weight 1), refusal at 4e-4 moved knowledge boundary 0.10 -> 0.40 without damage (2.5e-4: 0.10 -> 0.30,
# short of the target); narration at 2e-4 and the units organism's full update of 96 units at 7e-3 move role style
# but leave a quarter or more of the replies a bare "(smiles)" (5e-3: +0.19 only), so both still miss their targets.
LORA_LEARNING_RATE = 2e-4
LEARNING_RATE = {KNOWN: 7e-3, "refusal": 4e-4}


class OrganismError(RolemrcError, ValueError):
    """An organism setting that cannot be built."""


def option_name(field_name: str) -> str:
    """The command-line option of an OrganismConfig field (`organism build` and `organism calibrate` alike)."""
    return "--max-steps" if field_name == "steps" else "--" + field_name.replace("_", "-")


@dataclass(kw_only=True)
class OrganismConfig:
    """One organism trained from the SFT model `base`: a planted `kind` (DPO pairs that change PLANTED_DIMENSION[kind])
    or null (NULL_OF's pairs, chosen and rejected swapped at random per pair, so nothing systematic changes)."""

    kind: str = field(metadata={"help": " | ".join(KINDS)})
    out: str = field(metadata={"help": "organism folder (rerun with the same folder to resume)"})
    base: str = field(default="smollm2", metadata={"help": "the SFT model: a registry name (pulled on first use), a model "
                                                           "directory, or a hub id org/name[@revision]"})
    size: str = field(default="small", metadata={"help": "datagen size preset (test personas are never trained on)"})
    pairs: int = field(default=64, metadata={"help": "preference pairs trained on"})
    steps: int = field(default=32, metadata={"help": "DPO optimiser steps"})
    batch_size: int = field(default=2, metadata={"help": "pairs per optimiser step"})
    learning_rate: float | None = field(default=None, metadata={
        "help": f"DPO learning rate (default: {LORA_LEARNING_RATE:g} for the LoRA, {LEARNING_RATE['refusal']:g} for "
                f"refusal's, {LEARNING_RATE[KNOWN]:g} for the units organism's masked full update)"})
    beta: float = field(default=0.1, metadata={"help": "DPO beta"})
    sft_weight: float = field(default=1.0, metadata={
        "help": "weight of an SFT (NLL) loss on the chosen replies beside DPO's, as in RPO (trl's loss_type "
                "sigmoid + sft): it keeps a short chosen reply ending where it ends, against the loops plain DPO "
                "collapsed into; 0: plain DPO"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank (merged on save)"})
    lora_targets: str = field(default="all-linear", metadata={
        "help": "modules LoRA adapts: all-linear, or names separated by commas (gate_proj,up_proj: the change can "
                "only reach the model through its MLP units, where the probe reads)"})
    max_length: int = field(default=512, metadata={"help": "truncate pairs to this many tokens"})
    reply_tokens: int = field(default=32, metadata={"help": "length of the SFT model's own replies the pairs edit"})
    eval_tokens: int = field(default=32, metadata={"help": "generation length of the held-out eval"})
    eval_planted: int | None = field(default=None, metadata={
        "help": "held-out cases per planted dimension, shared by every kind (default: all of them)"})
    eval_others: int | None = field(default=None, metadata={
        "help": "held-out cases per other dimension (default: all of them)"})
    known_layers: int = field(default=3, metadata={
        "help": "units organism: layers its known units lie in (drawn with the seed)"})
    known_units: int = field(default=32, metadata={
        "help": "units organism: known units per layer (drawn with the seed); DPO trains only their MLP rows and columns"})
    seed: int = field(default=0, metadata={"help": "seed of the pair sample, the null's swaps, the known units and "
                                                   "training"})
    dtype: str = field(default="auto", metadata={"help": f"as train dpo's: {TRAIN_DTYPE_HELP}; the units organism "
                                                          "trains without LoRA"})

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise OrganismError(f"organism kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.learning_rate is None:
            self.learning_rate = LEARNING_RATE.get(self.kind, LORA_LEARNING_RATE)
        for name in ("pairs", "steps", "batch_size", "lora_r", "max_length", "reply_tokens", "eval_tokens",
                     "known_layers", "known_units"):
            if getattr(self, name) < 1:
                raise OrganismError(f"{option_name(name)} is {getattr(self, name)}; it must be >= 1")
        check_train_dtype(self.dtype, self.kind != KNOWN, option_name("dtype"))
        if self.eval_planted is not None and self.eval_planted < 1:
            raise OrganismError(f"--eval-planted is {self.eval_planted}; it must be >= 1")
        if self.eval_others is not None and self.eval_others < 0:
            raise OrganismError(f"--eval-others is {self.eval_others}; it must be >= 0")
        if self.sft_weight < 0:
            raise OrganismError(f"--sft-weight is {self.sft_weight}; it must be >= 0")
        if not 0 < self.learning_rate < 1 or self.beta <= 0:
            raise OrganismError(f"--learning-rate must be in (0, 1) and --beta > 0 (got {self.learning_rate}, "
                                f"{self.beta})")

    @property
    def dimension(self) -> str | None:
        """The dimension this organism's pairs change (None for the null)."""
        return PLANTED_DIMENSION[self.kind]

    @property
    def coupled(self) -> tuple[str, ...]:
        """The dimensions that move with this organism's planted one by the judge's construction (COUPLED)."""
        return COUPLED.get(self.kind, ())

    @property
    def pairs_kind(self) -> str:
        """The kind whose pair recipe (pairs.RECIPES) this organism's pairs come from."""
        return PAIRS_OF.get(self.kind, self.kind)

    def settings(self) -> dict[str, Any]:
        """Everything but where it goes and the dtype setting (the training stage's key holds the dtype it trained at;
        the known units' settings only for the units organism; sft_weight only when used, so organisms built before
        it existed keep their stage keys)."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k not in ("out", "dtype") and (self.kind == KNOWN or not k.startswith("known_"))
                and not (k == "sft_weight" and not v)}

    def training(self) -> dict[str, Any]:
        """What the trained model depends on (the settings but the held-out eval's): the training stage's key."""
        return {k: v for k, v in self.settings().items() if not k.startswith("eval_")}


# `--quick`: half the DPO steps (on SmolLM2 role style has moved as far by then, though knowledge boundary moves
# more: 0.16 -> 0.00 on 25 cases, against 0.08 after 32 steps). The held-out cases stay as many as the full
# calibration's: it splits them into a selection and a confirmation half.
QUICK = {"steps": 16}
