"""`rolemrc bench intervene`: what a restraint costs at inference. Forward time with the runtime hook
vs without (target <= 1.05) and of the baked checkpoint vs the original (target 1.00 within noise),
on the probe benchmark's models; all variants timed interleaved in one run."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rolemrc.bench.common import SIZES, interleaved, make_model_dir, random_cases
from rolemrc.intervene import Restraint, applied, bake
from rolemrc.intervene.spec import PAPER_FACTOR
from rolemrc.probe.cases import Cases, batches


def spread_restraint(layers: int, width: int, share: float, factor: float, seed: int = 0) -> Restraint:
    """`share` of the units of every layer at mlp.act, drawn at random (a diff's top-k looks like this)."""
    gen = torch.Generator().manual_seed(seed)
    k = max(1, int(share * width))
    units = {layer: sorted(torch.randperm(width, generator=gen)[:k].tolist()) for layer in range(layers)}
    return Restraint(name="bench", hook="mlp.act", units=units, factor=factor)


def logits(model, cases: Cases, batch_size: int, pad_id: int) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), use_cache=False).logits
                for _, ids, mask in batches(cases, batch_size, pad_id)]


def bench_size(size: str, root: Path, prompts: int, length: int, batch_size: int, repeats: int, share: float,
               device: str) -> dict:
    path = make_model_dir(size, root)
    tok = AutoTokenizer.from_pretrained(path)
    spec = SIZES[size]
    restraint = spread_restraint(spec["layers"], spec["intermediate"], share, factor=PAPER_FACTOR)
    baked_dir = root / f"{size}-baked"
    bake(path, restraint, baked_dir)
    original = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(device)
    baked = AutoModelForCausalLM.from_pretrained(baked_dir, dtype=torch.float32).eval().to(device)
    cases = random_cases(prompts, length, len(tok))

    def hooked():
        with applied(original, restraint):
            return logits(original, cases, batch_size, tok.pad_token_id)

    times = interleaved({"original": lambda: logits(original, cases, batch_size, tok.pad_token_id),
                         "hook": hooked,
                         "baked": lambda: logits(baked, cases, batch_size, tok.pad_token_id)}, repeats, device)
    agreement = max((a - b).abs().max().item() for a, b in zip(hooked(), logits(baked, cases, batch_size,
                                                                                   tok.pad_token_id)))
    return {"model": spec, "restrained_units": restraint.num_units, "factor": restraint.factor,
            **{f"{name}_s": round(t, 4) for name, t in times.items()},
            "hook_over_original": round(times["hook"] / times["original"], 3),
            "baked_over_original": round(times["baked"] / times["original"], 3),
            "hook_vs_baked_max_abs_logit": agreement}


def run(prompts: int = 256, length: int = 64, batch_size: int = 16, repeats: int = 7, share: float = 0.1,
        sizes: tuple[str, ...] = ("demo", "large"), device: str = "cpu") -> dict:
    """Run the intervene benchmark; returns a JSON-able dict."""
    result: dict = {"benchmark": "intervene", "prompts": prompts, "tokens_per_prompt": length,
                    "batch_size": batch_size, "repeats": repeats, "unit_share": share,
                    "threads": torch.get_num_threads(), "device": device,
                    "targets": {"hook_over_original": "<= 1.05", "baked_over_original": "1.00 within noise"}}
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            result[size] = bench_size(size, Path(tmp), prompts, length, batch_size, repeats, share, device)
    return result
