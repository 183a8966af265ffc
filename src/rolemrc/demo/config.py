"""What `rolemrc demo` runs: the base it starts from and the sizes that base implies."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rolemrc.intervene.spec import PAPER_FACTOR

EMBEDDED = "embedded"

# Per kind of base: the stage sizes that fit the time budget on 2 CPU cores. The embedded default trains
# its own 2.6M-parameter base (10 minutes in all); a pretrained base (SmolLM2-135M-Instruct) is fine-tuned
# with LoRA on a subset (datagen with 20 personas: 48 test cases; the steps in train/profiles/smollm2.yaml)
# and is also restrained at an ablation factor (30 minutes in all).
# The sweep stage (factors x top-k, each with random-unit controls) runs on `sweep_items` test cases spread
# evenly over the test set.
PRESETS: dict[str, dict] = {
    "embedded": {"size": "small", "profile": "tiny", "top_k": 64, "max_new_tokens": 96, "ablation": None,
                 "sweep_factors": (PAPER_FACTOR, 0.5, 0.0), "sweep_top_k": (16, 64), "sweep_items": 72},
    "pretrained": {"size": 20, "profile": "smollm2", "top_k": 512, "max_new_tokens": 64, "ablation": 0.0,
                   "sweep_factors": (0.5, 0.0), "sweep_top_k": (512,), "sweep_items": 48},
}


@dataclasses.dataclass
class DemoConfig:
    """What the demo runs; every field is part of some stage's cache key."""

    out: Path = Path("runs/demo")
    base: str = EMBEDDED           # embedded | a registry model (`rolemrc models list`) | a model directory
    size: str | int = "small"      # datagen preset or number of personas
    profile: str = "tiny"          # training profile (name or YAML path)
    hook: str = "mlp.act"          # probe hook point
    method: str = "frequency"      # the paper's selector, named: the demo reproduces the paper on purpose
    top_k: int = 64                # units in the restraint
    factor: float = PAPER_FACTOR   # the paper's 1 - 1e-6, named for the same reason
    ablation: float | None = None  # also restrain the same units at this factor (0: ablate) and evaluate that
    max_new_tokens: int = 96       # eval generation
    sweep: bool = True             # the restraint sweep with random-unit controls
    sweep_factors: tuple[float, ...] = (PAPER_FACTOR, 0.5, 0.0)
    sweep_top_k: tuple[int, ...] = (16, 64)
    sweep_controls: int = 2
    sweep_items: int = 72          # test cases the sweep generates for (spread over the test set), at most
    #                                48 new tokens each
    serve: bool = True
    vllm: bool | None = None       # serve on vLLM too: None = where installed
    force: bool = False

    @property
    def pretrained(self) -> bool:
        """Whether the demo starts from a pretrained model instead of training the embedded one."""
        return self.base != EMBEDDED

    @classmethod
    def for_base(cls, base: str = EMBEDDED, **settings) -> DemoConfig:
        """The preset for `base`'s kind, with `settings` (those not None) on top."""
        preset = PRESETS["pretrained" if base != EMBEDDED else "embedded"]
        return cls(base=base, **{**preset, **{k: v for k, v in settings.items() if v is not None}})
