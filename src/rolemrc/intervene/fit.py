"""Does a restraint fit the model it is applied to? Its shape (`Restraint.check_shape` on the model's layers and width,
no unmerged PEFT adapter) and its origin: a spec records the model its units were selected on (`Restraint.model`:
name, fingerprint and the fingerprint's kind). Applied to another model of the same shape, it is logged as a warning
once per pair of models (applying a DPO-derived restraint to its SFT model is a legitimate experiment), or with
`strict` refused. Everything that applies a spec to a model checks it here (runtime hooks, bake, LoRA export, check,
eval generate, sweep, serve); the spec itself is data (intervene/spec.py). Imports no torch (the CLI's help reads
STRICT_HELP): the model helpers are imported on use."""

from __future__ import annotations

import logging
from typing import Any

from rolemrc.core.hooks import num_layers, width
from rolemrc.intervene.spec import Restraint, RestraintError

log = logging.getLogger(__name__)

STRICT_HELP = "refuse a restraint selected on another model (default: a warning naming both)"
WARNED: set[tuple[str, str]] = set()   # (selected-on fingerprint, applied-to model) pairs already warned about


def validate(r: Restraint, model: Any) -> Restraint:
    """`r` if it fits the loaded `model` (a RestraintError for another shape, an InputError for a PEFT-wrapped model:
    merge it first); a model other than the one it was selected on is a warning (`check_origin`)."""
    from rolemrc.core.modeling import refuse_unmerged_peft

    refuse_unmerged_peft(model)
    r.check_shape(num_layers(model), width(model, r.hook))
    check_origin(r, model)
    return r


def check_origin(r: Restraint, model: Any, strict: bool = False, *, shape: bool = True) -> None:
    """Is `model` (a loaded model, or a model directory) the one `r`'s units were selected on? When it is another
    one: a logged warning naming both, once per pair of models, or with `strict` a RestraintError. Silent when the spec
    names no model or `model` cannot be told apart cheaply (a directory, where the spec recorded tensors: checked once
    loaded). A directory's shape is checked first, from its config.json (`check_config`): what every caller does
    before the model loads; `shape=False` leaves it to a caller that serves a restraint only on the models it fits."""
    from rolemrc.core.modeling import fingerprints, is_path, model_name

    if shape and is_path(model):
        check_config(r, model)
    recorded = r.model.get("fingerprint")
    if not recorded:
        return
    found: dict[str, str] = {}
    for kind in [r.model.get("fingerprint_of")] if r.model.get("fingerprint_of") else ["directory", "weights"]:
        found |= fingerprints(model, kind)   # a directory's first: hashing every weight only when it is needed
        if recorded in found.values():
            return
    if not found:
        return
    target = str(model) if is_path(model) else model_name(model)
    fingerprint = ", ".join(f"{kind} fingerprint {value}" for kind, value in found.items())
    message = (f"restraint {r.name!r} was selected on {r.model.get('name') or 'another model'} (fingerprint "
               f"{recorded}); it is applied to {target} ({fingerprint})")
    if strict:
        raise RestraintError(message + "; strict checking refuses it (without it: a warning)")
    pair = (recorded, target)   # once per pair: the directory's check before loading and the loaded model's after
    if pair not in WARNED:
        WARNED.add(pair)
        log.warning(message)


def check_config(r: Restraint, directory: Any) -> None:
    """`r` against a model directory's config.json alone (its layers, and its width at `r`'s hook point: hidden_size
    or intermediate_size), so a spec of another shape (a direction of another width, a unit out of range) is refused
    naming the directory before the model loads."""
    from rolemrc.probe.attribution import config_shape

    shape = config_shape(directory, r.hook)
    try:
        r.check_shape(shape["layers"], shape["width"])
    except RestraintError as exc:
        raise RestraintError(f"{exc} ({directory}/config.json)") from None
