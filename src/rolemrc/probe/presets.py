"""Named collection settings: `probe collect --preset NAME`, `CollectConfig.from_preset(NAME)` (torch-free: the CLI's
help lists the names). A preset sets fields of `CollectConfig`; settings given beside it override it, and the probe
file records the preset and the fields that differ from it (`preset`, `preset_overrides`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rolemrc.core.registry import Registry

ROLEMRC_CODE = "https://github.com/LuJunru/RoleMRC/blob/main/interpretation"


@dataclass(frozen=True)
class Preset:
    """Collection settings with what they reproduce (`description`) and where they were read (`source`)."""

    description: str
    source: str
    settings: dict[str, Any] = field(default_factory=dict)  # CollectConfig fields


PRESETS: Registry[Preset] = Registry("preset")

# interpret.py: HookedTransformer.run_with_cache(tokenizer.apply_chat_template(question, tokenize=False)) (a string:
# TransformerLens puts a BOS token before it, but not on Qwen2), the last position of each layer's hook tensor;
# visualize.py: per layer keep_top_percentage(matrix, 20) (argsort, the top int(width * 0.2) signed values),
# count_non_zero_by_dim, per evaluation dimension.
_AUTHORS = {"top_fraction": 0.2, "top_rounding": "down", "tokens": "last", "rank": "signed", "generation_prompt": False}

PRESETS.register("rolemrc-code")(Preset(
    "the RoleMRC authors' analysis of Llama-3.1: blocks.{i}.hook_mlp_out (the MLP's output), the last token of the "
    "prompt rendered without a generation prompt and after a BOS token, the top int(0.2 * width) units by signed "
    "value per layer", f"{ROLEMRC_CODE}/interpret.py and visualize.py",
    {"hook": "mlp.out", "prepend_bos": True, **_AUTHORS}))
PRESETS.register("rolemrc-code-qwen")(Preset(
    "their analysis of Qwen2.5: the hook list their script overwrites, blocks.{i}.hook_attn_out (the attention "
    "output), and no BOS token (TransformerLens adds none on Qwen2)", f"{ROLEMRC_CODE}/interpret.py",
    {"hook": "attn.out", "prepend_bos": False, **_AUTHORS}))
