"""`rolemrc bench probe`: collection speed against the forward-pass floor and the RoleMRC-code approach,
and peak memory at N vs 4N cases. Prints JSON; every ratio is measured side by side in one run."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from rolemrc.core.tiny import build_model, train_tokenizer
from rolemrc.probe.cases import Cases, batches
from rolemrc.probe.collect import CollectConfig, count_cases

SIZES = {
    "demo": {"hidden": 256, "layers": 4, "intermediate": 688, "heads": 4},
    "large": {"hidden": 1024, "layers": 8, "intermediate": 2816, "heads": 16},
}
# RoleMRC hooked the MLP output on Llama (TransformerLens `hook_mlp_out`): the baseline's point.
BASELINE_POINT, BRIDGE_NAME = "mlp.out", "blocks.{i}.hook_mlp_out"


def make_model_dir(size: str, root: Path) -> Path:
    """A random-init Llama of the given size, saved with a small tokenizer (TransformerLens boots from disk)."""
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
    return Cases(ids, membership, ["all"], 0, "bench")


def time_it(fn, repeats: int) -> float:
    """Median wall time of `repeats` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def plain_forward(model, cases: Cases, batch_size: int, pad_id: int) -> None:
    with torch.inference_mode():
        for _, input_ids, mask in batches(cases, batch_size, pad_id):
            model.base_model(input_ids=input_ids, attention_mask=mask, use_cache=False)


def rolemrc_code_approach(bridge, cases: Cases, n_layers: int, top_fraction: float) -> np.ndarray:
    """What the RoleMRC analysis code does: run_with_cache per prompt, keep the hooked activations,
    then top-k in numpy."""
    names = {BRIDGE_NAME.format(i=i) for i in range(n_layers)}
    kept = []
    for ids in cases.input_ids:
        _, cache = bridge.run_with_cache(torch.tensor([ids]), names_filter=lambda name: name in names)
        kept.append(np.stack([cache[BRIDGE_NAME.format(i=i)][0, -1].float().numpy() for i in range(n_layers)]))
    acts = np.stack(kept)  # [cases, layers, width]
    k = math.ceil(top_fraction * acts.shape[-1])
    top = np.argpartition(-acts, k - 1, axis=-1)[..., :k]
    active = np.zeros_like(acts, dtype=np.int64)
    np.put_along_axis(active, top, 1, axis=-1)
    return active.sum(0)


def bench_size(size: str, root: Path, prompts: int, length: int, batch_size: int, repeats: int) -> dict:
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_model_dir(size, root)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cases = random_cases(prompts, length, len(tok))
    out: dict = {"model": {**SIZES[size], "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}}
    forward = time_it(lambda: plain_forward(model, cases, batch_size, tok.pad_token_id), repeats)
    out["plain_forward_s"] = round(forward, 3)
    for point in ("mlp.act", BASELINE_POINT):
        config = CollectConfig(hook=point, batch_size=batch_size, progress=False)
        t = time_it(lambda: count_cases(model, tok, cases, config), repeats)
        out[f"collect_{point}_s"] = round(t, 3)
        out[f"collect_{point}_over_forward"] = round(t / forward, 3)
    ours = count_cases(model, tok, cases, CollectConfig(hook=BASELINE_POINT, batch_size=batch_size, progress=False))

    bridge_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    bridge = TransformerBridge.boot_transformers(str(path), hf_model=bridge_model, tokenizer=tok, device="cpu")
    n_layers = SIZES[size]["layers"]
    start = time.perf_counter()
    with torch.inference_mode():
        reference = rolemrc_code_approach(bridge, cases, n_layers, 0.2)
    baseline = time.perf_counter() - start
    out["rolemrc_code_s"] = round(baseline, 3)
    out["speedup_over_rolemrc_code"] = round(baseline / out[f"collect_{BASELINE_POINT}_s"], 2)
    # eager (bridge) vs sdpa (ours) attention differ by float rounding: report agreement, do not assert it
    agree = (reference == ours.count[0].numpy()).mean()
    out["counts_agreement_with_baseline"] = round(float(agree), 4)
    return out


MEMORY_SCRIPT = """
import json, resource, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from rolemrc.bench.probe import random_cases
from rolemrc.probe.collect import CollectConfig, count_cases
path, n, length, bs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
config = CollectConfig(hook="mlp.act", batch_size=bs, progress=False)
count_cases(model, tok, random_cases(bs, length, len(tok), seed=1), config)  # warm-up: one batch
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
count_cases(model, tok, random_cases(n, length, len(tok)), config)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_rss_mb": after / 1024, "growth_mb": (after - before) / 1024}))
"""


def peak_memory(path: Path, n: int, length: int, batch_size: int) -> dict:
    """Peak RSS of a fresh process collecting n cases (and its growth over a one-batch warm-up)."""
    res = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(path), str(n), str(length), str(batch_size)],
                         capture_output=True, text=True, check=True, env={**os.environ, "TQDM_DISABLE": "1"})
    return json.loads(res.stdout.strip().splitlines()[-1])


def run(prompts: int = 256, length: int = 64, batch_size: int = 16, repeats: int = 3,
        sizes: tuple[str, ...] = ("demo", "large")) -> dict:
    """Run the probe benchmark; returns a JSON-able dict."""
    result: dict = {"benchmark": "probe", "prompts": prompts, "tokens_per_prompt": length, "batch_size": batch_size,
                    "threads": torch.get_num_threads(), "device": "cpu",
                    "targets": {"collect_over_forward": "<= 1.10", "speedup_demo": ">= 3", "speedup_large": ">= 1.4",
                                "memory_4n_over_n": "<= 1.1"}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for size in sizes:
            result[size] = bench_size(size, root, prompts, length, batch_size, repeats)
        small, big = peak_memory(root / sizes[0], prompts, length, batch_size), \
            peak_memory(root / sizes[0], 4 * prompts, length, batch_size)
        result["memory"] = {"n": prompts, "n_cases": small, "4n_cases": big,
                            "peak_rss_ratio_4n_over_n": round(big["peak_rss_mb"] / small["peak_rss_mb"], 3)}
    return result
