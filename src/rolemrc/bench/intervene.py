"""`rolemrc bench intervene`: what a restraint costs at inference. Forward time under each hooked kind's runtime
hook vs without (scale <= 1.05; patch and direction <= 1.10), of one batch whose rows carry a mix of the kinds
(scale, patch, direction, none: the engine's per-slot rows) vs unrestrained (>= 0.9x its speed), and of the baked
checkpoint vs the original (1.00 within noise), on the probe benchmark's models. Every variant is timed interleaved
in one run, each timed run at least a second; a ratio is the median over rounds with its min-max, flagged as noise
where the rounds disagree by more than 10%."""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rolemrc.bench.common import MIN_SECONDS, SIZES, interleaved, kind_restraints, make_model_dir, random_cases
from rolemrc.generate.scales import SlotScales
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
               device: str, min_seconds: float = MIN_SECONDS) -> dict:
    path = make_model_dir(size, root)
    tok = AutoTokenizer.from_pretrained(path)
    spec = SIZES[size]
    restraint = spread_restraint(spec["layers"], spec["intermediate"], share, factor=PAPER_FACTOR)
    baked_dir = root / f"{size}-baked"
    bake(path, restraint, baked_dir)
    original = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(device)
    baked = AutoModelForCausalLM.from_pretrained(baked_dir, dtype=torch.float32).eval().to(device)
    cases = random_cases(prompts, length, len(tok))
    kinds = kind_restraints(spec["layers"], spec["intermediate"], share)
    mix = SlotScales(original, batch_size)

    @contextmanager
    def mix_rows():
        """The engine's per-slot rows, cycling through scale, patch, direction and none (installed untimed)."""
        for row in range(batch_size):
            mix.assign(row, [*kinds.values(), None][row % 4])
        try:
            yield
        finally:
            for row in range(batch_size):
                mix.release(row)

    def mixed():
        with torch.inference_mode():
            for _, ids, mask in batches(cases, batch_size, tok.pad_token_id):
                mix.rows = slice(0, len(ids))
                original(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)

    def hooked(r: Restraint):
        with applied(original, r):
            return logits(original, cases, batch_size, tok.pad_token_id)

    fns = {"original": lambda: logits(original, cases, batch_size, tok.pad_token_id),
           "hook": lambda: hooked(restraint), **{f"hook_{k}": lambda r=r: hooked(r) for k, r in kinds.items()},
           "mix_of_kinds": mixed, "baked": lambda: logits(baked, cases, batch_size, tok.pad_token_id)}
    times = interleaved(fns, repeats, device, contexts={"mix_of_kinds": mix_rows}, min_seconds=min_seconds)
    agreement = max((a - b).abs().max().item() for a, b in zip(hooked(restraint), logits(baked, cases, batch_size,
                                                                                             tok.pad_token_id)))
    return {"model": spec, "restrained_units": restraint.num_units, "factor": restraint.factor,
            **{f"{name}_s": round(t, 4) for name, t in times.items()},
            "calls_per_timed_run": times.calls,
            "hook_over_original": times.ratio("hook", "original"),
            **{f"hook_{k}_over_original": times.ratio(f"hook_{k}", "original") for k in kinds},
            "baked_over_original": times.ratio("baked", "original"),
            "unrestrained_over_mix_of_kinds": times.ratio("original", "mix_of_kinds"),
            "hook_vs_baked_max_abs_logit": agreement}


def run(prompts: int = 256, length: int = 64, batch_size: int = 16, repeats: int = 7, share: float = 0.1,
        sizes: tuple[str, ...] = ("demo", "large"), device: str = "cpu", min_seconds: float = MIN_SECONDS) -> dict:
    """Run the intervene benchmark; returns a JSON-able dict."""
    result: dict = {"benchmark": "intervene", "prompts": prompts, "tokens_per_prompt": length,
                    "batch_size": batch_size, "repeats": repeats, "unit_share": share, "min_seconds": min_seconds,
                    "threads": torch.get_num_threads(), "device": device,
                    "targets": {"hook_over_original": "<= 1.05", "hook_patch_over_original": "<= 1.10",
                                "hook_direction_over_original": "<= 1.10",
                                "unrestrained_over_mix_of_kinds": ">= 0.9 (the mix at 0.9x unrestrained speed or better)",
                                "baked_over_original": "1.00 within noise"},
                    "ratios": "median over interleaved rounds, with min-max; noise: the rounds disagree by > 10%"}
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            result[size] = bench_size(size, Path(tmp), prompts, length, batch_size, repeats, share, device, min_seconds)
    return result
