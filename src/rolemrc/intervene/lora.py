"""A restraint exported as an exact LoRA adapter (standard PEFT layout, servable by PEFT and vLLM).

Scaling units of one projection's input (columns U of W) or output (rows R) by f is the rank-|U| edit
W[:, U] (f - 1) e_U^T (resp. e_R (f - 1) W[R, :]), so with lora_alpha = r (scaling 1) B @ A is exactly the
bake's weight change: the fold's side in HOOK_POINTS decides which factor is one-hot. Projecting a unit vector d out
of the input (output) side is the rank-1 edit -(W d) d^T (resp. -d (d^T W)). A patch adds a constant: not a LoRA. A
revert adds alpha (W_ref - W) to every weight of its scope: a LoRA where that change is low-rank (a LoRA-trained
model's, merged), factored exactly by `intervene.delta` from both checkpoints, and refused by weight where it is not.

`LoraExporter` never loads a model directory: a skeleton on the meta device says where each fold lives, and only the
folded projections' weights are read from the checkpoint, so exporting costs what the adapter holds (a
server exports inline restraints per request this way, beside a vLLM process that holds the model).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rolemrc.core.hooks import HOOK_POINTS, hook_point, layout_of, module_at
from rolemrc.core.modeling import (
    dir_fingerprint,
    is_path,
    loaded_model,
    meta_model,
    model_fingerprint,
    model_name,
    resolve_model,
)
from rolemrc.core.version import __version__
from rolemrc.intervene.bake import Fold, lora_exportable, provenance_metadata, reference_dir, restraint_fold
from rolemrc.intervene.delta import revert_pairs, stores_in_out
from rolemrc.intervene.fit import check_origin, validate
from rolemrc.intervene.spec import KindUnsupportedError, LoraRankError, Restraint, RestraintError, as_restraint

VLLM_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
STALE_S = 3600.0   # a hidden folder in an adapter cache this old is an export or eviction that died midway


def rank_fix(units: int) -> str:
    """What to do about a restraint of `units` units in one layer that a server's LoRA rank does not hold."""
    baked = "serve it baked, a checkpoint per A/B arm (`rolemrc ab bake`, then `ab create --baked`)"
    if units > VLLM_RANKS[-1]:
        return f"vLLM's LoRA rank (max_lora_rank) goes to {VLLM_RANKS[-1]} at most, so {baked}"
    return f"raise max_lora_rank (at most {VLLM_RANKS[-1]} on vLLM) or {baked}"


@dataclass
class LoraReport:
    out_dir: str
    rank: int
    max_units: int
    target_modules: list[str]
    layers: list[int]
    source_fingerprint: str
    restraint: dict

    def to_dict(self) -> dict:
        return asdict(self)


def lora_rank(max_units: int, rank: int | None = None) -> int:
    """`rank` if given (at least `max_units`), else the smallest vLLM rank that holds `max_units` (or
    `max_units` itself beyond them)."""
    if rank is not None:
        if rank < max_units:
            raise RestraintError(f"rank {rank} is below the {max_units} units of the largest layer")
        return rank
    return next((v for v in VLLM_RANKS if v >= max_units), max_units)


def lora_units(r: Restraint) -> int:
    """The rank a restraint's largest layer needs: its units (scale), or 1 (a direction)."""
    return 1 if r.kind == "direction" else max(len(u) for u in r.units.values())


def lora_pair(weight: torch.Tensor, fold: Fold, r: Restraint, layer: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [rank, in], B [out, rank]) in float32 with B @ A equal to the fold's change of `weight` (as stored) at
    `layer`, zero-padded to `rank`."""
    w = weight.detach().double().cpu()
    w = w.T if fold.transposed else w  # [out, in]
    if r.kind == "direction":
        d = torch.tensor(r.directions[layer], dtype=torch.float64)[None, :]   # [1, width]
        a, b = (d, -(w @ d.T)) if fold.side == "in" else (d @ w, -d.T)
    else:
        idx = torch.tensor(r.units[layer])
        if fold.side == "in":
            a, b = F.one_hot(idx, w.shape[1]).double(), w[:, idx] * (r.factor - 1)
        else:
            a, b = w[idx, :], F.one_hot(idx, w.shape[0]).double().T * (r.factor - 1)
    return pad_pair(a, b, rank)


def pad_pair(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) in float32, zero-padded to `rank` (exact: the padding adds nothing to B @ A)."""
    pad = rank - a.shape[0]
    return F.pad(a.float(), (0, 0, 0, pad)).contiguous(), F.pad(b.float(), (0, pad)).contiguous()


class CheckpointWeights:
    """Single tensors read from a model directory's safetensors files (sharded or not), by parameter name."""

    def __init__(self, model_dir: Path) -> None:
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            shards = json.loads(index.read_text())["weight_map"]
            self.files = {key: model_dir / file for key, file in shards.items()}
        else:
            from safetensors import safe_open

            self.files = {}
            for file in sorted(model_dir.glob("*.safetensors")):
                with safe_open(str(file), "pt") as f:
                    self.files.update(dict.fromkeys(f.keys(), file))
        if not self.files:
            raise RestraintError(f"{model_dir}: no safetensors weights to export a LoRA adapter from")

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        # checkpoints may drop the base model's prefix (GPT-2's "h.0..." for "transformer.h.0...")
        key = name if name in self.files else name.split(".", 1)[-1]
        if key not in self.files:
            raise RestraintError(f"the checkpoint has no tensor {name!r}")
        with safe_open(str(self.files[key]), "pt") as f:
            return f.get_tensor(key)


class LoraExporter:
    """Checks and exports restraints for one model without loading its weights: a model directory (a meta-device
    skeleton, and only the folded projections' tensors read from its safetensors), or a loaded transformers model
    (its own parameters)."""

    def __init__(self, model: Any) -> None:
        if is_path(model):
            self.src: Path | None = resolve_model(model)
            self.source = str(model)   # as named (a hub id with its revision); `src` is where it resolved to
            self.model = meta_model(self.src)
            self.fingerprint = dir_fingerprint(self.src)
            self.weights: Any = CheckpointWeights(self.src)
        else:
            self.model, self.src, self.source = loaded_model(model), None, model_name(model)
            self.fingerprint = model_fingerprint(model)
            self.weights = {n: p.detach() for n, p in model.named_parameters()}
        self.names = {id(m): n for n, m in self.model.named_modules()}

    def check(self, spec: Any, max_rank: int | None = None) -> Restraint:
        """The restraint, if LoRA expresses it exactly on this model (within `max_rank` units per layer; a revert:
        within rank `max_rank`, by an SVD of every weight it moves), else a RestraintError saying why."""
        r = as_restraint(spec)
        if r.kind == "revert":
            self._revert_pairs(r, max_rank)
            return r
        return self._plan(r, max_rank)[0]

    def _revert_pairs(self, r: Restraint, cap: int | None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """A revert's (A, B) per module it moves, exact, each of rank at most `cap` (default: vLLM's largest), read
        from this model's and the reference's checkpoints (`intervene.delta`); a RestraintError where none holds it."""
        validate(r, self.model)
        reference = CheckpointWeights(reference_dir(r))
        return revert_pairs(self.model, self.weights, reference, r, cap or VLLM_RANKS[-1])

    def _plan(self, spec: Any, max_rank: int | None = None, *,
              checked: bool = False) -> tuple[Restraint, dict[int, Fold]]:
        """The restraint and its fold per layer (each layer folded once), or a RestraintError; `checked`: it was
        validated against this model already."""
        r = as_restraint(spec)
        if not checked:
            validate(r, self.model)
        folds = self._folds(r)
        if max_rank is not None and (units := lora_units(r)) > max_rank:
            raise LoraRankError(f"restraint {r.name!r} has {units} units in one layer; this server's LoRA rank "
                                f"holds {max_rank}; {rank_fix(units)}")
        return r, folds

    def target_modules(self) -> list[str]:
        """The target_modules names of every projection a restraint on this model can be exported into (a
        server that wraps only these in LoRA layers can load any exportable restraint)."""
        return sorted({_target_name(self.model, row.fold.weight) for row in HOOK_POINTS.values()
                       if row.lora and lora_exportable(self.model, row.name)})

    def _folds(self, r: Restraint) -> dict[int, Fold]:
        """Each layer's fold, or a RestraintError when LoRA cannot express `r` exactly."""
        if r.kind in ("patch", "revert"):
            why = ("adds a constant per unit (a bias)" if r.kind == "patch" else
                   "moves weights toward another checkpoint by a delta that is full-rank in general")
            raise KindUnsupportedError(f"restraint {r.name!r} is a {r.kind}, which {why}: a LoRA adapter cannot hold it "
                                 "exactly; bake it (`rolemrc intervene bake`; A/B arms: `rolemrc ab bake`)" +
                                 (" or apply it as a runtime hook" if r.kind == "patch" else ""))
        # fold_target refuses, with the row's reason, points that cannot fold
        folds = {layer: restraint_fold(self.model, r, layer) for layer in r.sites}
        bias = any(fold.scales_bias or (r.kind == "direction" and fold.side == "out" and fold.module.bias is not None)
                   for fold in folds.values())
        if bias or not hook_point(r.hook).lora:
            why = ("the fold also changes the projection's bias, and a LoRA adapter only adds to weights"
                   if bias else "its HOOK_POINTS row does not allow LoRA")
            raise RestraintError(f"{r.hook} cannot be exported as an exact LoRA adapter: {why}; bake it instead")
        for fold in folds.values():
            fold.untied_weight(self.model)
        return folds

    def export(self, spec: Any, out_dir: str | os.PathLike, *, rank: int | None = None,
               strict: bool = False) -> LoraReport:
        """Write `spec` as a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors): B @ A equals
        the bake's weight change, computed in float32 from the checkpoint's weights. `strict`: refuse a restraint
        selected on another model (default: a warning)."""
        r = as_restraint(spec)
        check_origin(r, self.src if self.src is not None else self.model, strict)
        if self.src is not None and Path(out_dir).resolve() == self.src.resolve():
            raise RestraintError("LoRA output must differ from the source model directory")
        if r.kind == "revert":
            return self._write_revert(r, Path(out_dir), rank)
        return self._write(*self._plan(r), Path(out_dir), rank)

    def _write(self, r: Restraint, folds: dict[int, Fold], out: Path, rank: int | None) -> LoraReport:
        max_units = lora_units(r)
        r_pad = lora_rank(max_units, rank)
        pairs = {}
        for layer, fold in folds.items():
            name = self.names[id(fold.module)]
            pairs[name] = lora_pair(self.weights[f"{name}.weight"], fold, r, layer, r_pad)
        targets = [_target_name(self.model, hook_point(r.hook).fold.weight)]
        self._save(r, pairs, {"r": r_pad, "target_modules": targets, "layers_to_transform": r.sites,
                              "fan_in_fan_out": fold.transposed}, out)
        return LoraReport(str(out), r_pad, max_units, targets, r.sites, self.fingerprint, r.to_dict())

    def _write_revert(self, r: Restraint, out: Path, rank: int | None) -> LoraReport:
        """A revert's adapter: every module it moves targeted by its full name, its factors padded to one rank."""
        pairs = self._revert_pairs(r, rank)
        if not pairs:
            raise RestraintError(f"restraint {r.name!r}: no Linear weight in its scope differs from the reference "
                                 f"{r.reference['name']}, so there is nothing to export")
        needed = max(a.shape[0] for a, _ in pairs.values())
        r_pad = lora_rank(needed, rank)
        targets = sorted(pairs)
        in_out = any(stores_in_out(self.model.get_submodule(n)) for n in targets)
        self._save(r, {n: pad_pair(a, b, r_pad) for n, (a, b) in pairs.items()},
                   {"r": r_pad, "target_modules": targets, "fan_in_fan_out": in_out}, out)
        blocks = layout_of(self.model).blocks + "."
        layers = sorted({int(n[len(blocks):].split(".")[0]) for n in targets if n.startswith(blocks)})
        return LoraReport(str(out), r_pad, needed, targets, layers, self.fingerprint, r.to_dict())

    def _save(self, r: Restraint, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], where: dict[str, Any],
              out: Path) -> None:
        """Write the adapter: each module's padded (A, B), PEFT's config (`where`: rank, target_modules and how they
        store weights) and the provenance."""
        from safetensors.torch import save_file

        tensors = {f"base_model.model.{name}.lora_{x}.weight": t for name, pair in pairs.items()
                   for x, t in zip("AB", pair, strict=True)}
        # adapter_config.json holds PEFT's keys only (peft warns on any other); the provenance sits beside it in
        # rolemrc.json, as in a baked checkpoint, and in the safetensors metadata
        provenance = {"stage": "lora", "source_model": self.source, "source_fingerprint": self.fingerprint,
                      "restraint": r.to_dict(), "source": r.source, "version": __version__}
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": self.source,
                  "lora_alpha": where["r"], "bias": "none", "lora_dropout": 0.0, "use_rslora": False,
                  "inference_mode": True, **where}
        out.mkdir(parents=True, exist_ok=True)
        (out / "adapter_config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
        (out / "rolemrc.json").write_text(json.dumps(provenance, indent=1, sort_keys=True))
        save_file(tensors, str(out / "adapter_model.safetensors"),
                  metadata=provenance_metadata(self.source, self.fingerprint, r))

    def cached(self, spec: Any, cache_dir: str | os.PathLike, *, rank: int | None = None,
               checked: bool = False) -> Path:
        """The adapter for `spec` under `cache_dir`, keyed by model fingerprint, `Restraint.digest` and rank;
        exported once (written beside and renamed, so a killed export leaves nothing half-written) and touched on every
        use (its mtime orders `evict_adapters`). `checked`: `spec`
        passed `check` on this exporter already (a server checks each restraint once, when it resolves it)."""
        r = as_restraint(spec)
        r_pad = lora_rank(lora_units(r), rank)
        out = Path(cache_dir) / f"{self.fingerprint}-{r.digest}-r{r_pad}"
        if (out / "adapter_model.safetensors").is_file():
            with contextlib.suppress(OSError):   # the most recently used, for `evict_adapters`
                os.utime(out)
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".export-"))
            try:
                self._write(*self._plan(r, checked=checked), tmp, r_pad)
                tmp.rename(out)
            except OSError:   # another process exported it first
                if not (out / "adapter_model.safetensors").is_file():
                    raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return out


def evict_adapters(cache_dir: str | os.PathLike, *, max_count: int, max_bytes: int,
                   keep: Collection[os.PathLike] = ()) -> list[Path]:
    """Delete the least recently used adapters under `cache_dir` (oldest mtime first, so processes sharing the folder
    agree) until at most `max_count` adapters of at most `max_bytes` in all are left, sparing those in `keep` (in
    use); the ones deleted. Each is renamed to a hidden name before it is deleted, so no reader finds half of one;
    hidden folders older than STALE_S (an export or eviction killed midway) go too."""
    folder = Path(cache_dir)
    if not folder.is_dir():
        return []
    spared = {Path(p).name for p in keep}
    adapters = []   # (mtime, bytes, path)
    for entry in os.scandir(folder):
        with contextlib.suppress(FileNotFoundError):   # another process evicting it now
            if entry.name.startswith("."):
                if time.time() - entry.stat().st_mtime > STALE_S:
                    shutil.rmtree(entry.path, ignore_errors=True)
            elif entry.is_dir():
                size = sum(f.stat().st_size for f in os.scandir(entry.path) if f.is_file())
                adapters.append((entry.stat().st_mtime, size, Path(entry.path)))
    adapters.sort()
    count, total = len(adapters), sum(size for _, size, _ in adapters)
    evicted = []
    for _, size, path in adapters:
        if count <= max_count and total <= max_bytes:
            break
        if path.name in spared:
            continue
        doomed = path.with_name(f".evict-{os.getpid()}-{path.name}")
        try:
            path.rename(doomed)
        except OSError:   # another process evicted it first
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        count, total = count - 1, total - size
        evicted.append(path)
    return evicted


def _target_name(model: nn.Module, role: str) -> str:
    """The target_modules entry of a layout role: its bare name (down_proj, as PEFT and vLLM expect), or its
    path inside the block where the bare name is ambiguous (GPT-2's mlp.c_proj vs attn.c_proj)."""
    path = layout_of(model).modules[role]
    bare = path.rsplit(".", 1)[-1]
    clashes = sum(n.rsplit(".", 1)[-1] == bare for n, _ in module_at(model, "block", 0)[1].named_modules())
    return bare if clashes == 1 else path


def export_lora(model: Any, spec: Any, out_dir: str | os.PathLike, *, rank: int | None = None,
                strict: bool = False) -> LoraReport:
    """Write `spec` as a PEFT LoRA adapter for `model`, a HF model directory or a loaded transformers model (see
    `LoraExporter.export`); the adapter's base_model_name_or_path is the model as named (or the loaded model's directory)."""
    return LoraExporter(model).export(spec, out_dir, rank=rank, strict=strict)
