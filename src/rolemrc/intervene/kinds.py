"""Restraints of every kind from a probe's numbers (`Restraint.kind`): the selected units patched to their mean
activation under the SFT model or reverted toward its weights, one direction per layer from a difference of means
(the paired probe's DPO - SFT, or one model's chosen - rejected replies over preference pairs), and weight reversions
by layer or for the whole model. Each records where its numbers came from.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolemrc.intervene.spec import REVERT_SCOPES, Restraint, RestraintError, parse_layers

if TYPE_CHECKING:
    from rolemrc.probe.diff import DiffResult

SELECTED_KINDS = ("scale", "patch", "revert")   # kinds `select` makes of a selector's units (revert: scope units)
# what a direction is the difference of: the paired probe's DPO - SFT means (a diff), or one model's chosen - rejected
# replies over preference pairs
CONTRASTS = ("dpo-sft", "chosen-rejected")


def load_means(source: str | os.PathLike | DiffResult, dimension: str) -> tuple[DiffResult, str]:
    """A diff holding activation moments of `dimension` (a folder or file, or a DiffResult) and its origin."""
    from rolemrc.intervene.inputs import IN_MEMORY, input_file
    from rolemrc.probe.diff import DiffResult, load_diff

    diff, origin = (source, IN_MEMORY) if isinstance(source, DiffResult) else (load_diff(source), str(input_file(source)))
    if dimension not in diff.mean_a or not bool(diff.mean_a[dimension].any() or diff.mean_b[dimension].any()):
        raise RestraintError(f"{origin}: no activation moments of {dimension!r} (a diff of probe files collected with "
                             "moments holds mean_a and mean_b)")
    return diff, origin


def as_patch(r: Restraint, means: str | os.PathLike | DiffResult, dimension: str) -> Restraint:
    """`r`'s units patched to their mean activation on `dimension`'s cases under the diff's A side (the SFT model).
    The diff must be of `r`'s hook point and shape, and its B side the model `r` was selected on (where both record
    one): a mean from another model's probe is refused."""
    from rolemrc.intervene.inputs import model_of

    diff, origin = load_means(means, dimension)
    shape = tuple(diff.mean_a[dimension].shape)
    if diff.hook != r.hook or (r.model and shape != (r.model.get("layers"), r.model.get("width"))):
        raise RestraintError(f"{origin}: means of {diff.hook} {shape[0]} x {shape[1]}, but the units are of {r.hook}"
                             + (f" {r.model.get('layers')} x {r.model.get('width')}" if r.model else ""))
    probed = model_of(diff.meta, "b_").get("fingerprint")
    if probed and r.model.get("fingerprint") and probed != r.model["fingerprint"]:
        raise RestraintError(f"{origin}: a diff whose B side is the model with fingerprint {probed}, but the units were "
                             f"selected on {r.model.get('name')} ({r.model['fingerprint']}): patch with the means of "
                             "the pair the units came from")
    mean = diff.mean_a[dimension]
    values = {layer: mean[layer, units].double().tolist() for layer, units in r.units.items()}
    return Restraint(name=r.name, hook=r.hook, units=r.units, kind="patch", values=values,
                     source={**r.source, "means": origin, "values": "mean activation under the diff's A side"},
                     model=r.model, reference=model_of(diff.meta, "a_"))


def as_revert(r: Restraint, alpha: float, reference: dict[str, Any]) -> Restraint:
    """`r`'s units' weights (their rows into the MLP, their column of its down projection) moved toward `reference`
    (name, fingerprint: the SFT model) by `alpha`."""
    if not reference.get("name"):
        raise RestraintError("a unit revert needs the SFT model: the diff or attribution records none; name it with "
                             "--reference")
    return Restraint(name=r.name, hook=r.hook, units=r.units, kind="revert", alpha=alpha, scope="units",
                     reference=reference, source=r.source, model=r.model)


def direction_restraint(diff: str | os.PathLike | DiffResult, dimension: str, *, layers: str | None = None,
                        top_layers: int | None = None, name: str | None = None) -> Restraint:
    """One direction per layer, the difference of mean activations B - A (DPO - SFT) on `dimension`'s cases at the
    diff's hook point and token policy, in `layers` (default all) or the `top_layers` of them where it is longest."""
    from rolemrc.intervene.inputs import model_of

    loaded, origin = load_means(diff, dimension)
    delta = loaded.mean_b[dimension].double() - loaded.mean_a[dimension].double()
    return directions_of(delta, loaded.hook, origin, f"the mean activations of {dimension!r}", layers=layers,
                         top_layers=top_layers, name=name or f"{dimension.replace('_', '-')}-direction",
                         model=model_of(loaded.meta, "b_"),
                         source={"diff": origin, "dimension": dimension, "contrast": CONTRASTS[0],
                                 "direction": f"mean B - mean A at tokens={loaded.meta.get('tokens')}"})


def pair_direction_restraint(model: Any, pairs: Any, *, dimension: str | None = None, layers: str | None = None,
                             top_layers: int | None = None, name: str | None = None, **settings: Any) -> Restraint:
    """One direction per layer, the difference of mean activations chosen - rejected of `model` (the DPO model, or
    another) over the preference pairs (those of `dimension` when given), each side read over its reply's tokens
    (`probe.contrast`), in `layers` (default all) or the `top_layers` where it is longest. `settings`: attribution's
    (hook, batch_size, max_length, limit, dimension_field, dtype, device, progress)."""
    from rolemrc.intervene.inputs import model_of
    from rolemrc.probe.contrast import REPLY_TOKENS, reply_means

    means = reply_means(model, pairs, dimension=dimension, **settings)
    label = dimension.replace("_", "-") if dimension else "pairs"
    return directions_of(means.delta, means.hook, means.origin, "the chosen and rejected replies' mean activations",
                         layers=layers, top_layers=top_layers, name=name or f"{label}-chosen-rejected-direction",
                         model=model_of(means.model),
                         source={"pairs": means.origin, "dimension": dimension or "all", "pairs_used": means.pairs,
                                 "contrast": CONTRASTS[1],
                                 "direction": f"mean chosen - mean rejected, each reply read as {REPLY_TOKENS}"})


def directions_of(delta: Any, hook: str, origin: str, what: str, *, layers: str | None, top_layers: int | None,
                  name: str, model: dict[str, Any], source: dict[str, Any]) -> Restraint:
    """A direction restraint at `hook` from `delta` (float64 [layers, width]: a difference of means, `what` differs):
    per layer its row, normalised, in `layers` (default all) or the `top_layers` of them where it is longest. The
    source gains the layers and each one's norm; `model` (where known) gains the shape."""
    n_layers, width = delta.shape
    chosen = parse_layers(layers, n_layers) or list(range(n_layers))
    norms = delta.norm(dim=1)
    chosen = [layer for layer in chosen if norms[layer] > 0]
    if top_layers is not None:
        if top_layers < 1:
            raise RestraintError(f"top_layers must be >= 1, got {top_layers}")
        chosen = sorted(sorted(chosen, key=lambda layer: -float(norms[layer]))[:top_layers])
    if not chosen:
        raise RestraintError(f"{origin}: {what} do not differ in layers {layers or 'all'}")
    return Restraint(name=name, hook=hook, kind="direction", directions={layer: delta[layer].tolist() for layer in chosen},
                     source={**source, "layers": layers or "all", **({"top_layers": top_layers} if top_layers else {}),
                             "norms": {layer: float(norms[layer]) for layer in chosen}},
                     model=model and {**model, "layers": n_layers, "width": width})


def revert_restraint(reference: str | os.PathLike, alpha: float, scope: str, *, layers: str | None = None,
                     name: str | None = None) -> Restraint:
    """A revert of the whole model (scope "model") or of the blocks of `layers` (scope "layers") toward `reference`,
    a model directory or hub id (its fingerprint recorded where it resolves here)."""
    from rolemrc.core.errors import RolemrcError
    from rolemrc.core.modeling import dir_fingerprint, resolve_model

    if not 0.0 <= alpha <= 1.0:
        raise RestraintError(f"alpha must lie in [0, 1] (0: the model as it is, 1: the reference), got {alpha}")
    if scope not in REVERT_SCOPES[:2]:
        raise RestraintError(f"revert_restraint makes scopes model and layers; a units revert comes from `select` "
                             f"(kind revert), not {scope!r}")
    try:
        fingerprint = dir_fingerprint(resolve_model(reference))
    except RolemrcError as exc:
        raise RestraintError(f"the reference {reference} cannot be found: {exc}") from None
    chosen = parse_layers(layers) if scope == "layers" else []
    if scope == "layers" and not chosen:
        raise RestraintError("a revert of scope layers needs layers, e.g. '3-5'")
    return Restraint(name=name or f"revert-{scope}-{alpha:g}", hook="mlp.act", kind="revert", alpha=alpha, scope=scope,
                     layers=chosen or [], reference={"name": str(reference), "fingerprint": fingerprint},
                     source={"reference": str(Path(reference)), "scope": scope, "layers": layers or "all"})
