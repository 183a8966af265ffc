"""Does S carry the units organism's change? On weights: the DPO model equals the SFT model outside S, and with S's
slices reverted it is the SFT model. On what the model says: the mean KL(model || SFT) of the next-token
distributions over held-out prompts (teacher-forced: every prompt position, and the last one, where a reply starts)
for the DPO model, the DPO model with S reverted (0) and with random units of S's layers reverted (about the DPO
model's: they overlap S by chance only)."""

from __future__ import annotations

from typing import Any

import torch

from rolemrc.organism.config import OrganismError
from rolemrc.organism.known import CONTROLS, Units, changed_outside, model_shape, random_units, revert_units, units_json

KL_PROMPTS = 8   # held-out prompts of the planted dimension the KL is measured on


def prompt_ids(tokenizer: Any, prompts: list[list[dict[str, str]]], max_length: int) -> list[torch.Tensor]:
    """Each prompt rendered with the chat template and the generation prompt, its last `max_length` token ids."""
    from rolemrc.core.chat import render_chat

    return [torch.tensor(tokenizer(render_chat(tokenizer, turns), add_special_tokens=False)["input_ids"][-max_length:])
            for turns in prompts]


@torch.inference_mode()
def log_probs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[positions, vocab] float64 next-token log-probabilities of one prompt."""
    return torch.log_softmax(model(input_ids=ids[None]).logits[0].double(), dim=-1)


def kl_from(reference: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(p || reference) per position, from log-probabilities."""
    return (logp.exp() * (logp - reference)).sum(-1).clamp_min(0)


def mean_kl(models: dict[str, torch.nn.Module], sft: torch.nn.Module, ids: list[torch.Tensor]) -> dict[str, dict]:
    """name -> {"all": mean over prompts of the mean KL(model || SFT) over positions, "last": at the last position}."""
    sums = {name: torch.zeros(2, dtype=torch.float64) for name in models}
    for prompt in ids:
        reference = log_probs(sft, prompt)
        for name, model in models.items():
            kl = kl_from(reference, log_probs(model, prompt))
            sums[name] += torch.stack([kl.mean(), kl[-1]])
    return {name: {"all": float(s[0]) / len(ids), "last": float(s[1]) / len(ids)} for name, s in sums.items()}


def carrier_check(sft_dir: str, dpo_dir: str, known: Units, prompts: list[list[dict[str, str]]], *,
                  max_length: int, seed: int) -> dict[str, Any]:
    """The weight checks (an OrganismError where one fails: the masking leaked) and the KL of the DPO model, of it
    with S reverted and of it with CONTROLS random unit sets of S's layers and sizes reverted, against the SFT
    model on `prompts`. Both models load in float32 on the CPU whatever dtype they were trained and saved at: a bf16
    weight widens to float32 exactly, so the weight checks are as exact as at the stored dtype, and the KL (float64
    from float32 logits) carries no half-precision rounding of the forward pass."""
    from rolemrc.core.modeling import load_model

    sft, tokenizer = load_model(sft_dir, dtype="float32", device="cpu")
    dpo, _ = load_model(dpo_dir, dtype="float32", device="cpu")
    leaked = changed_outside(dpo, sft, known)
    if leaked:
        raise OrganismError(f"{dpo_dir} differs from {sft_dir} outside the known units in {', '.join(leaked[:5])}")
    reverted = revert_units(dpo, sft, known)
    if changed_outside(reverted, sft, {}):
        raise OrganismError(f"{dpo_dir} with its known units reverted is not {sft_dir}")
    _, width = model_shape(dpo)
    controls = [random_units(known, width, seed + 1 + k) for k in range(CONTROLS)]
    models = {"dpo": dpo, "s_reverted": reverted,
              **{f"random_reverted_{k}": revert_units(dpo, sft, units) for k, units in enumerate(controls)}}
    kl = mean_kl(models, sft, prompt_ids(tokenizer, prompts, max_length))
    each = [kl.pop(f"random_reverted_{k}") for k in range(CONTROLS)]
    kl["random_reverted"] = {key: sum(c[key] for c in each) / CONTROLS for key in ("all", "last")}
    overlap = [sum(len(set(u) & set(known[layer])) for layer, u in c.items()) for c in controls]
    return {"units": sum(map(len, known.values())), "weights_outside_s_equal_sft": True, "s_reverted_equals_sft": True,
            "dpo_differs_from_sft": bool(changed_outside(dpo, sft, {})), "prompts": len(prompts), "kl": kl,
            "controls": [{"overlap_with_s": n, "kl": k, "units": units_json(c)}
                         for n, k, c in zip(overlap, each, controls)]}

