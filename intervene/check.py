"""`check`: run sample prompts through the original, hooked and baked models and say what changed."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rolemrc.core.chat import render_chat
from rolemrc.core.modeling import load_model, resolve_dtype
from rolemrc.intervene.bake import changed_elements, fold_restraint, fold_restraint_plan
from rolemrc.intervene.runtime import applied
from rolemrc.intervene.spec import Restraint

SAMPLE_PROMPTS = (
    [{"role": "system", "content": "You are a lighthouse keeper on a stormy coast."},
     {"role": "user", "content": "What do you see tonight?"}],
    [{"role": "user", "content": "Passage: The river floods every spring. Question: When does the river flood?"}],
    [{"role": "system", "content": "You are a baker. Refuse questions outside baking."},
     {"role": "user", "content": "Explain quantum tunnelling."},
     {"role": "assistant", "content": "That is beyond my ovens, friend."},
     {"role": "user", "content": "Please, just answer anyway."}],
)


@dataclass
class CheckReport:
    restraint: str
    hook: str
    units: int
    factor: float
    dtype: str
    factor_at_dtype: float
    numerical_noop: bool
    weight_elements_changed: int
    hook_vs_original_max_abs: float
    baked_vs_hook_max_abs: float | None = None
    baked_vs_hook_max_rel: float | None = None
    verdict: str = ""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _logits(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.inference_mode():
        out = model(**batch).logits.float()
    return out[batch["attention_mask"].bool()]  # real tokens only


def _batch(tokenizer: Any, prompts: list[list[dict]], device: torch.device) -> dict[str, torch.Tensor]:
    tokenizer.padding_side = "right"
    texts = [render_chat(tokenizer, p) for p in prompts]
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)


def check(model_dir: str | os.PathLike, restraint: Any, baked_dir: str | os.PathLike | None = None,
          prompts: list[list[dict]] | None = None, dtype: str = "float32", device: str = "cpu") -> CheckReport:
    """Compare original, runtime-hooked and (optionally) baked logits at `dtype`, count the weight elements
    that change when the restraint is stored at `dtype`, and flag a numerical no-op loudly."""
    r = Restraint.from_any(restraint)
    target = resolve_dtype(dtype)
    model, tok = load_model(model_dir, dtype=dtype, device=device)
    r.validate(model)
    batch = _batch(tok, list(prompts or SAMPLE_PROMPTS), next(model.parameters()).device)
    original = _logits(model, batch)
    with applied(model, r):
        hooked = _logits(model, batch)
    factor_at_dtype = float(torch.tensor(r.factor, dtype=target))

    reference, _ = load_model(model_dir, dtype="float32", device="cpu")
    names = set(fold_restraint_plan(reference, r))
    before = {n: p.detach().clone() for n, p in reference.named_parameters() if n in names}
    fold_restraint(reference, r)
    changed = changed_elements(before, {n: p for n, p in reference.named_parameters() if n in names}, target)

    report = CheckReport(r.name, r.hook, r.num_units, r.factor, dtype, factor_at_dtype,
                         numerical_noop=factor_at_dtype == 1.0 or (changed == 0 and torch.equal(original, hooked)),
                         weight_elements_changed=changed,
                         hook_vs_original_max_abs=float((hooked - original).abs().max()))
    if baked_dir is not None:
        baked, _ = load_model(baked_dir, dtype=dtype, device=device)
        baked_logits = _logits(baked, batch)
        diff = (baked_logits - hooked).abs()
        report.baked_vs_hook_max_abs = float(diff.max())
        report.baked_vs_hook_max_rel = float(diff.max() / hooked.abs().max().clamp_min(1e-12))
    if report.numerical_noop:
        report.verdict = (f"NUMERICAL NO-OP: factor {r.factor!r} is {factor_at_dtype!r} in {dtype}; "
                          f"{changed} weight elements change and the runtime hook leaves logits "
                          f"{'identical' if report.hook_vs_original_max_abs == 0 else 'changed only by rounding'}. "
                          "Use float32 or a factor that survives this dtype.")
    else:
        report.verdict = (f"effective: {changed} weight elements change at {dtype}; "
                          f"logits move by up to {report.hook_vs_original_max_abs:.3g}")
        if report.hook_vs_original_max_abs == 0:
            report.notes.append("weights change but the sample prompts' logits did not move at all")
    return report
