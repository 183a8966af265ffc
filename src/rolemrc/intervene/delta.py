"""A revert's weight change as exact low-rank factors: what its LoRA adapter holds (`intervene.lora`).

A revert moves each weight W of its scope to W + alpha D, with D = W_ref - W (zero outside the scope's rows or columns:
masking keeps the rank at most D's). A model trained with LoRA and merged has D = -scaling B A up to one rounding of
each element of W, so an SVD of D in float64 keeps the k singular values above eps (‖W‖_F + ‖D‖_F), eps that of the
coarser stored dtype: a bound on the spectral norm of one rounding of every element, which is all it drops. Then
B = alpha U_k S_k and A = V_kᵀ. Refused, naming the weight: a change outside Linear layers' weights (embeddings, norms,
biases: LoRA of those is not expressed here), a delta that is not low-rank (its factors would hold at least as many
numbers as the weight: a full fine-tune's change), and one above the rank cap."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from rolemrc.intervene.bake import reference_mismatch, revert_slices
from rolemrc.intervene.spec import Restraint, RestraintError

Pair = tuple[torch.Tensor, torch.Tensor]   # (A [k, in], B [out, k]), float64
BAKE = "bake the revert instead (`rolemrc intervene bake`)"


def revert_pairs(model: nn.Module, weights: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
                 r: Restraint, cap: int) -> dict[str, Pair]:
    """Module name -> (A, B) with B @ A = alpha D, for each Linear weight in the scope of `r` (a revert) that differs
    from the reference. `model`: the model's skeleton (names, shapes, layout); `weights`, `reference`: tensors by
    parameter name, as stored. A RestraintError names the first weight that no LoRA of rank at most `cap` holds
    exactly, every change outside Linear weights refused first (before any SVD)."""
    slices = [(name, tuple(p.shape), index, linear_module(model, name)) for name, p, index in revert_slices(model, r)]
    for name, shape, index, module in slices:
        if module is None and scope_delta(weights, reference, r, name, shape, index)[1].any():
            kind = type(model.get_submodule(name.rpartition(".")[0])).__name__
            raise RestraintError(f"restraint {r.name!r} cannot be exported as a LoRA adapter: {name} ({kind}) differs "
                                 f"from the reference {r.reference['name']}, and the adapter adds only to Linear "
                                 f"layers' weights (LoRA of embeddings, norms or biases is not expressed here); {BAKE}")
    pairs = {}
    for name, shape, index, module in slices:
        if module is not None:
            w, d, eps = scope_delta(weights, reference, r, name, shape, index)
            if d.any():
                pairs[name.rpartition(".")[0]] = low_rank_pair(*((w.T, d.T) if stores_in_out(module) else (w, d)),
                                                               eps, r, name, cap)
    return pairs


def stores_in_out(module: nn.Module) -> bool:
    """GPT-2's Conv1D stores its weight [in, out] (PEFT's fan_in_fan_out); nn.Linear [out, in]."""
    return type(module).__name__ == "Conv1D"


def linear_module(model: nn.Module, name: str) -> nn.Module | None:
    """The Linear layer (or Conv1D) whose weight the parameter `name` is, else None."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    return module if attr == "weight" and (isinstance(module, nn.Linear) or stores_in_out(module)) else None


def scope_delta(weights: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], r: Restraint, name: str,
                shape: tuple[int, ...], index: tuple) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(W, D = W_ref - W) as stored, float64 on the CPU and zero outside `index`, and the machine epsilon of the coarser
    of the two stored dtypes."""
    here = weights[name]
    try:
        there = reference[name]
    except (KeyError, RestraintError):
        raise reference_mismatch(r, name, shape) from None
    if tuple(there.shape) != shape:
        raise reference_mismatch(r, name, shape)
    w, d = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
    w[index] = here[index].to("cpu", torch.float64)
    d[index] = there[index].to("cpu", torch.float64) - w[index]
    return w, d, max(torch.finfo(here.dtype).eps, torch.finfo(there.dtype).eps)


def low_rank_pair(w: torch.Tensor, d: torch.Tensor, eps: float, r: Restraint, name: str, cap: int) -> Pair:
    """(A, B) with B @ A = alpha d ([out, in]) but for its singular values below eps (‖w‖_F + ‖d‖_F); a RestraintError
    naming `name` where the rank kept is not low or above `cap`."""
    u, s, vh = torch.linalg.svd(d, full_matrices=False)
    k = int((s > eps * (w.norm() + d.norm())).sum())
    out, into = d.shape
    why = (f"not low-rank: its factors would hold at least as many numbers as the {out} x {into} weight (a full "
           "fine-tune's change; a LoRA-trained model's has the LoRA's rank)" if k * (out + into) >= out * into else
           f"above the rank cap {cap}" if k > cap else "")
    if why:
        raise RestraintError(f"restraint {r.name!r} cannot be exported as an exact LoRA adapter: {name} moves toward "
                             f"the reference by a delta of numerical rank {k}, {why}; {BAKE}")
    return vh[:k], u[:, :k] * (r.alpha * s[:k])
