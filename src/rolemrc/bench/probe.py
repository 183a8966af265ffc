"""`rolemrc bench probe`: collection speed against the forward-pass floor and the RoleMRC-code approach,
peak memory at N vs 4N cases and, with nproc > 1, collection in nproc processes (torchrun) against one.
Prints JSON; every ratio is measured side by side in one run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from rolemrc.bench.common import MIN_SECONDS, SIZES, interleaved, make_model_dir, random_cases
from rolemrc.core.hooks import HOOK_POINTS
from rolemrc.probe.cases import Cases, batches
from rolemrc.probe.collect import CollectConfig, count_cases
from rolemrc.probe.presets import PRESETS

# The RoleMRC code's settings (the `rolemrc-code` preset): its hook point, the MLP output (TransformerLens
# `hook_mlp_out`), is the baseline's.
BASELINE_POINT = PRESETS.get("rolemrc-code").settings["hook"]
BRIDGE_NAME = HOOK_POINTS[BASELINE_POINT].bridge


def plain_forward(model, cases: Cases, batch_size: int, pad_id: int) -> None:
    with torch.inference_mode():
        for _, input_ids, mask in batches(cases, batch_size, pad_id):
            model.base_model(input_ids=input_ids.to(model.device), attention_mask=mask.to(model.device), use_cache=False)


def rolemrc_code_approach(bridge, cases: Cases, n_layers: int, top_fraction: float, device: str = "cpu") -> np.ndarray:
    """What the RoleMRC analysis code does: run_with_cache per prompt, keep the hooked activations,
    then the top int(top_fraction * width) in numpy."""
    names = {BRIDGE_NAME.format(i=i) for i in range(n_layers)}
    kept = []
    for ids in cases.input_ids:
        _, cache = bridge.run_with_cache(torch.tensor([ids], device=device), names_filter=lambda name: name in names)
        kept.append(np.stack([cache[BRIDGE_NAME.format(i=i)][0, -1].float().cpu().numpy() for i in range(n_layers)]))
    acts = np.stack(kept)  # [cases, layers, width]
    k = max(1, int(top_fraction * acts.shape[-1]))
    top = np.argpartition(-acts, k - 1, axis=-1)[..., :k]
    active = np.zeros_like(acts, dtype=np.int64)
    np.put_along_axis(active, top, 1, axis=-1)
    return active.sum(0)


NO_RESAMPLES = "mlp.act_resamples0"   # collection with no bootstrap replicates, beside the default


def bench_size(size: str, root: Path, prompts: int, length: int, batch_size: int, repeats: int, device: str,
               min_seconds: float = MIN_SECONDS) -> dict:
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_model_dir(size, root)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(device)
    cases = random_cases(prompts, length, len(tok))
    out: dict = {"model": {**SIZES[size], "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}}
    configs = {point: CollectConfig(hook=point, batch_size=batch_size, progress=False) for point in ("mlp.act", BASELINE_POINT)}
    configs[NO_RESAMPLES] = CollectConfig(hook="mlp.act", batch_size=batch_size, progress=False, resamples=0)
    preset = CollectConfig.from_preset("rolemrc-code", batch_size=batch_size, progress=False)
    ours = count_cases(model, tok, cases, preset)
    bridge_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(device)
    bridge = TransformerBridge.boot_transformers(str(path), hf_model=bridge_model, tokenizer=tok, device=device)
    n_layers = SIZES[size]["layers"]
    results = {}

    def rolemrc_code() -> None:
        with torch.inference_mode():
            results["reference"] = rolemrc_code_approach(bridge, cases, n_layers, 0.2, device)

    times = interleaved({"forward": lambda: plain_forward(model, cases, batch_size, tok.pad_token_id),
                         **{point: lambda c=c: count_cases(model, tok, cases, c) for point, c in configs.items()},
                         "rolemrc_code": rolemrc_code}, repeats, device, min_seconds=min_seconds)
    out["plain_forward_s"] = round(times["forward"], 3)
    for point in configs:
        out[f"collect_{point}_s"] = round(times[point], 3)
        out[f"collect_{point}_over_forward"] = times.ratio(point, "forward")
    out["resamples_overhead"] = times.ratio("mlp.act", NO_RESAMPLES)   # the default 5 against none
    out["rolemrc_code_s"] = round(times["rolemrc_code"], 3)
    out["speedup_over_rolemrc_code"] = times.ratio("rolemrc_code", BASELINE_POINT, digits=2)
    out["calls_per_timed_run"] = times.calls
    reference = results["reference"]
    # eager (bridge) vs sdpa (ours) attention differ by float rounding: report agreement, do not assert it
    agree = (reference == ours.count[0].cpu().numpy()).mean()
    out["counts_agreement_with_baseline"] = round(float(agree), 4)
    return out


MEMORY_SCRIPT = """
import json, resource, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from rolemrc.bench.common import random_cases
from rolemrc.probe.collect import CollectConfig, count_cases
path, n, length, bs, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
cuda = device.startswith("cuda")
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(device)
config = CollectConfig(hook="mlp.act", batch_size=bs, progress=False)
count_cases(model, tok, random_cases(bs, length, len(tok), seed=1), config)  # warm-up: one batch
peak = (lambda: torch.cuda.max_memory_allocated() / 2**20) if cuda else \
    (lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
before = peak()
count_cases(model, tok, random_cases(n, length, len(tok)), config)
after = peak()
print(json.dumps({"peak_mb": after, "growth_mb": after - before, "measure": "cuda max allocated" if cuda else "rss"}))
"""


def peak_memory(path: Path, n: int, length: int, batch_size: int, device: str) -> dict:
    """Peak memory (RSS, or CUDA allocated) of a fresh process collecting n cases, and its growth over a
    one-batch warm-up."""
    res = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(path), str(n), str(length), str(batch_size), device],
                         capture_output=True, text=True, check=True, env={**os.environ, "TQDM_DISABLE": "1"})
    return json.loads(res.stdout.strip().splitlines()[-1])


NPROC_SCRIPT = """
import json, statistics, sys, time, torch, torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer
from rolemrc.bench.common import random_cases, sync
from rolemrc.probe.collect import CollectConfig, count_cases, rank_device
from rolemrc.probe.distributed import process_group
path, n, length, bs, repeats, device = *sys.argv[1:2], *map(int, sys.argv[2:6]), rank_device(sys.argv[6])
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(device)
cases, config = random_cases(n, length, len(tok)), CollectConfig(hook="mlp.act", batch_size=bs, progress=False)
with process_group(torch.device(device)) as shard:  # one process group for every pass
    count_cases(model, tok, cases, config)  # warm-up
    times = []
    for _ in range(repeats):
        if shard.world > 1:
            dist.barrier()
        sync(device)
        start = time.perf_counter()
        count_cases(model, tok, cases, config)  # each rank's share, then the all-reduce
        sync(device)
        times.append(time.perf_counter() - start)
    if shard.main:
        print(json.dumps({"seconds": statistics.median(times)}))
"""


def processes(path: Path, nproc: int, prompts: int, length: int, batch_size: int, repeats: int, device: str) -> dict:
    """Collection in 1 and in `nproc` processes (`torchrun`, the CPU threads split evenly among them), launched
    one after the other over the same cases: median seconds per pass, cases/s and the speedup."""
    threads = torch.get_num_threads()
    out: dict = {"processes": nproc, "threads_per_process": {1: threads, nproc: max(1, threads // nproc)}}
    with tempfile.NamedTemporaryFile("w", suffix=".py") as script:
        script.write(NPROC_SCRIPT)
        script.flush()
        for n in (1, nproc):
            env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": str(out["threads_per_process"][n])}
            res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
                                  script.name, str(path), str(prompts), str(length), str(batch_size), str(repeats), device],
                                 capture_output=True, text=True, check=True, env=env)
            seconds = json.loads(res.stdout.strip().splitlines()[-1])["seconds"]
            out[f"nproc_{n}_s"], out[f"nproc_{n}_cases_per_s"] = round(seconds, 3), round(prompts / seconds, 1)
    out[f"speedup_{nproc}_over_1"] = round(out[f"nproc_{nproc}_cases_per_s"] / out["nproc_1_cases_per_s"], 3)
    return out


def run(prompts: int = 256, length: int = 64, batch_size: int = 16, repeats: int = 3,
        sizes: tuple[str, ...] = ("demo", "large"), device: str = "cpu", nproc: int = 1,
        min_seconds: float = MIN_SECONDS) -> dict:
    """Run the probe benchmark; returns a JSON-able dict. With nproc > 1, each size also compares collection
    in nproc processes with one (`processes`)."""
    result: dict = {"benchmark": "probe", "prompts": prompts, "tokens_per_prompt": length, "batch_size": batch_size,
                    "threads": torch.get_num_threads(), "device": device, "repeats": repeats, "min_seconds": min_seconds,
                    "ratios": "median over interleaved rounds, with min-max; noise: the rounds disagree by > 10%",
                    "targets": {"collect_over_forward": "<= 1.10", "speedup_demo": ">= 3", "speedup_large": ">= 1.4",
                                "memory_4n_over_n": "<= 1.1"}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for size in sizes:
            result[size] = bench_size(size, root, prompts, length, batch_size, repeats, device, min_seconds)
            if nproc > 1:
                result[size]["processes"] = processes(root / size, nproc, prompts, length, batch_size, repeats, device)
        small, big = (peak_memory(root / sizes[0], n, length, batch_size, device) for n in (prompts, 4 * prompts))
        result["memory"] = {"n": prompts, "n_cases": small, "4n_cases": big,
                            "peak_ratio_4n_over_n": round(big["peak_mb"] / small["peak_mb"], 3)}
    return result
