"""Restraint specs (docs/ARCHITECTURE.md "Restraint spec") as plain data: parse and validate a spec's own content,
read and write its file, the digest that identifies what it does, and its unit ranges against a model's shape given as
numbers. A spec touches no model: checking it against one (and against the model it was selected on) is
`intervene.fit`'s. Imports no torch (serve and the CLI's help import it)."""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from rolemrc.core.artifacts import FORMATS, check_format, describe, identify
from rolemrc.core.errors import InputError, RolemrcError
from rolemrc.core.hooks import HOOK_POINTS
from rolemrc.core.io import read_yaml

PAPER_FACTOR = 1 - 1e-6   # the RoleMRC paper's restraint: scale the selected units by 1 - 1e-6
# What a restraint does (`Restraint.kind`): scale units (the paper's), patch them to a constant each, project one
# direction per layer out of the hook point's tensor, or revert weights from the model toward a reference checkpoint.
KINDS = ("scale", "patch", "direction", "revert")
HOOKED = ("scale", "patch", "direction")   # the kinds applied as runtime hooks (revert is baked)
REVERT_SCOPES = ("model", "layers", "units")   # revert: every weight, the blocks of `layers`, or the units' rows/columns
# A spec names its kind under `restraint` (`kind` is the file's: a restraint spec); absent, it is a scale.
KIND_FIELDS = MappingProxyType({"scale": ("factor", "units"), "patch": ("units", "values"), "direction": ("directions",),
               "revert": ("alpha", "scope", "reference")})   # what each kind's spec holds (and its digest covers)


class RestraintError(RolemrcError, ValueError):
    """A restraint spec is malformed or does not fit the model."""


class KindUnsupportedError(RestraintError):
    """A restraint of a kind that this way of applying it (an engine, a LoRA adapter) cannot apply exactly."""


class LoraRankError(RestraintError):
    """A restraint with more units in one layer than a server's LoRA rank holds (served baked instead)."""



def parse_layers(text: str | None, n_layers: int | None = None) -> list[int] | None:
    """'12-31' / '3,5,7-9' -> sorted layer list (None for no restriction)."""
    if text is None or str(text).strip() in ("", "all"):
        return None
    layers: set[int] = set()
    for part in str(text).split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            start, end = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise RestraintError(f"bad layer range {part!r}: use e.g. '12-31' or '3,5,7-9'") from None
        if start > end:
            raise RestraintError(f"bad layer range {part!r}: start after end")
        layers.update(range(start, end + 1))
    if n_layers is not None and max(layers) >= n_layers:
        raise RestraintError(f"layer {max(layers)} out of range: the model has {n_layers} layers (0-{n_layers - 1})")
    return sorted(layers)


@dataclass
class Restraint:
    """What to restrain at one hook point, by `kind` (KINDS):
    - scale: `units` per layer times `factor` (the paper's 1 - 1e-6 by default);
    - patch: `units` per layer set to a constant each, `values` per layer (aligned with the sorted units), such as their
      mean activation under the SFT model (`reference`: the model the values are of);
    - direction: per layer of `directions`, a unit vector of the hook point's width projected out of its tensor;
    - revert: weights moved from the model toward `reference` (the checkpoint it was trained from: name, fingerprint)
      by `alpha` in [0, 1], over `scope`: the whole model, the blocks of `layers`, or the MLP units' rows and columns
      (`units`, at an MLP hook point). Baked, not hooked.
    """

    name: str
    hook: str
    units: dict[int, list[int]] = field(default_factory=dict)
    factor: float = PAPER_FACTOR
    source: dict[str, Any] = field(default_factory=dict)
    # the model the units were selected on (its diff's or attribution's B model): name, fingerprint, fingerprint_of
    # ("directory": its files, "weights": its tensors; "" unknown), layers, width; {} for a spec made by hand
    model: dict[str, Any] = field(default_factory=dict)
    kind: str = "scale"
    values: dict[int, list[float]] = field(default_factory=dict)
    directions: dict[int, list[float]] = field(default_factory=dict)
    alpha: float | None = None
    scope: str = ""
    layers: list[int] = field(default_factory=list)
    reference: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise RestraintError("a restraint needs a non-empty 'name'")
        if not isinstance(self.hook, str):
            raise RestraintError(f"hook must be one of {', '.join(HOOK_POINTS)}, got {self.hook!r}")
        if self.hook.startswith("layers."):  # accept the full hook name form "layers.{i}.mlp.act" minus index
            self.hook = self.hook.split(".", 2)[-1]
        if self.hook not in HOOK_POINTS:
            raise RestraintError(f"unknown hook point {self.hook!r}; choose one of {', '.join(HOOK_POINTS)}")
        try:
            self.factor = float(self.factor)
        except (TypeError, ValueError):
            raise RestraintError(f"factor must be a number, got {self.factor!r}") from None
        if not math.isfinite(self.factor):
            raise RestraintError(f"factor must be finite, got {self.factor}")
        if self.kind not in KINDS:
            raise RestraintError(f"unknown restraint kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        needs_units = self.kind in ("scale", "patch") or (self.kind == "revert" and self.scope == "units")
        if needs_units or self.units:
            self.units, order = _units(self.units)
        if self.kind == "patch":
            self.values = _values(self.values, self.units, order)
        elif self.values:
            raise RestraintError(f"'values' belong to a patch, not a {self.kind} restraint")
        if self.kind == "direction":
            if self.units:
                raise RestraintError("a direction restraint takes 'directions' (a vector per layer), not 'units'")
            self.directions = _directions(self.directions)
        elif self.directions:
            raise RestraintError(f"'directions' belong to a direction restraint, not a {self.kind} one")
        if self.kind == "revert":
            self._check_revert()
        elif self.alpha is not None or self.scope or self.layers:
            raise RestraintError(f"'alpha', 'scope' and 'layers' belong to a revert, not a {self.kind} restraint")

    def _check_revert(self) -> None:
        try:
            self.alpha = float(self.alpha)   # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise RestraintError(f"a revert needs alpha, a number in [0, 1], got {self.alpha!r}") from None
        if not 0.0 <= self.alpha <= 1.0:
            raise RestraintError(f"alpha must lie in [0, 1] (0: the model as it is, 1: the reference), got {self.alpha}")
        if self.scope not in REVERT_SCOPES:
            raise RestraintError(f"a revert's scope is one of {', '.join(REVERT_SCOPES)}, got {self.scope!r}")
        if not isinstance(self.reference, dict) or not self.reference.get("name"):
            raise RestraintError("a revert needs the reference checkpoint it reverts toward: reference: {name: "
                                 "<the SFT model's directory or hub id>, fingerprint: ...}")
        if self.scope == "layers":
            if not self.layers or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in self.layers):
                raise RestraintError("a revert of scope layers needs 'layers', a non-empty list of layer indices")
            self.layers = sorted(set(self.layers))
        elif self.layers:
            raise RestraintError(f"'layers' belong to a revert of scope layers, not {self.scope}")
        if self.scope == "units" and HOOK_POINTS[self.hook].width != "intermediate":
            raise RestraintError(f"a unit-level revert reverts MLP units' rows and columns: its hook is mlp.act or "
                                 f"mlp.post, not {self.hook}")
        if self.scope != "units" and self.units:
            raise RestraintError(f"'units' belong to a revert of scope units, not {self.scope}")

    @property
    def num_units(self) -> int:
        return sum(len(v) for v in self.units.values())

    @property
    def hooked(self) -> bool:
        """Whether it applies as a runtime hook (every kind but revert, which is baked)."""
        return self.kind in HOOKED

    @property
    def sites(self) -> list[int]:
        """The layers whose hook point tensor the hook rewrites."""
        return list(self.directions) if self.kind == "direction" else list(self.units)

    @property
    def digest(self) -> str:
        """A short hash of what the restraint does (hook, kind and its fields; not its name, source or the model it was
        selected on): the one identity that batches, caches and adapters key restraints by. A scale's is what it was
        before kinds existed."""
        what: dict[str, Any] = {"hook": self.hook, "factor": self.factor,
                                "units": {str(k): v for k, v in sorted(self.units.items())}}
        if self.kind != "scale":
            what = {"hook": self.hook, "kind": self.kind, **self.kind_fields()}
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]

    def kind_fields(self) -> dict[str, Any]:
        """The fields of its kind (KIND_FIELDS), as the spec writes them."""
        out: dict[str, Any] = {}
        for name in KIND_FIELDS[self.kind]:
            value = getattr(self, name)
            out[name] = {int(k): list(v) for k, v in value.items()} if name in ("units", "values", "directions") else value
        if self.kind == "revert":
            out |= {"units": {int(k): list(v) for k, v in self.units.items()}} if self.scope == "units" else {}
            out |= {"layers": list(self.layers)} if self.scope == "layers" else {}
        if self.kind == "patch" and self.reference:
            out["reference"] = self.reference
        return out

    def check_shape(self, layers: int, width: int) -> None:
        """A RestraintError unless the spec fits a model of `layers` layers with `width` units at its hook point: every
        layer and unit in range, and that shape the one its units were selected on (where the spec records it)."""
        shape = (self.model.get("layers"), self.model.get("width"))
        if None not in shape and shape != (layers, width):
            raise RestraintError(f"restraint {self.name!r} was selected on {self.model.get('name') or 'a model'} with "
                                 f"{shape[0]} layers of {shape[1]} {self.hook} units; this model has {layers} of {width}")
        for layer in [*self.units, *self.directions, *self.layers]:
            if layer >= layers:
                raise RestraintError(f"restraint {self.name!r}: layer {layer} out of range (model has {layers} layers)")
        for layer, ids in self.units.items():
            if ids[-1] >= width:
                raise RestraintError(f"restraint {self.name!r}: unit {ids[-1]} in layer {layer} out of range "
                                     f"({self.hook} has width {width})")
        for layer, vector in self.directions.items():
            if len(vector) != width:
                raise RestraintError(f"restraint {self.name!r}: the direction of layer {layer} has {len(vector)} "
                                     f"entries, but {self.hook} has width {width}")

    def summary(self) -> dict[str, Any]:
        """What a person reads: name, hook, factor, digest, unit counts per layer (the unit ids are in the spec) and,
        for a selected spec, the share of all units at the hook point and units per layer (min, median, max)."""
        spread = (self.source.get("coverage") or {}).get("per_layer")
        what = {"scale": {"factor": self.factor}, "patch": {}, "direction": {"layers": list(self.directions)},
                "revert": {"alpha": self.alpha, "scope": self.scope, "reference": self.reference.get("name"),
                           **({"layers": self.layers} if self.scope == "layers" else {})}}[self.kind]
        return {"name": self.name, "restraint": self.kind, "hook": self.hook, **what, "digest": self.digest,
                "units": self.num_units, "per_layer": {int(k): len(v) for k, v in sorted(self.units.items())},
                **({"share": self.source["coverage"]["share"],
                    "units_per_layer": {k: spread[k] for k in ("min", "median", "max")}} if spread else {})}

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "hook": self.hook, **({"restraint": self.kind} if self.kind != "scale" else {}),
               **self.kind_fields()}
        if self.source:
            out["source"] = self.source
        if self.model:
            out["model"] = self.model
        return out

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"kind": "restraint", "format": FORMATS["restraint"], **self.to_dict()}   # a file says what it is
        text = json.dumps(data, indent=1) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
        path.write_text(text)
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Restraint:
        if not isinstance(data, dict):
            raise RestraintError(f"a restraint spec must be a mapping, got {type(data).__name__}")
        if data.get("kind", "restraint") != "restraint":
            raise RestraintError(f"a {data['kind']!r} document, not a restraint spec")
        try:
            check_format(None, data, "restraint")
        except InputError as exc:
            raise RestraintError(str(exc)) from None
        kind = data.get("restraint", "scale")
        if kind not in KINDS:
            raise RestraintError(f"unknown restraint kind {kind!r}; choose one of {', '.join(KINDS)}")
        allowed = {"name", "hook", "source", "model", "kind", "format", "restraint", *KIND_FIELDS[kind],
                   *{"revert": ("units", "layers"), "patch": ("reference",)}.get(kind, ())}
        unknown = set(data) - allowed
        if unknown:
            raise RestraintError(f"unknown spec field(s) {sorted(unknown)} for a {kind} restraint (its fields: "
                                 f"{', '.join(KIND_FIELDS[kind])})")
        missing = {"name", "hook", *(f for f in KIND_FIELDS[kind] if f != "factor")} - set(data)
        if missing:
            raise RestraintError(f"spec is missing {sorted(missing)}")
        fields = {k: data[k] for k in allowed & set(data) - {"kind", "format", "restraint", "source", "model"}}
        return cls(**fields, kind=kind, source=data.get("source") or {}, model=data.get("model") or {})

    @classmethod
    def load(cls, path: str | os.PathLike) -> Restraint:
        if identify(path) not in ("restraint", "yaml", "json", "missing"):   # another kind of file: say which
            raise RestraintError(f"{path} is {describe(path)}; expected a restraint spec (from `rolemrc intervene select`)")
        data = read_yaml(path, RestraintError, "restraint spec")  # YAML is a superset of JSON
        try:
            return cls.from_dict(data)
        except RestraintError as exc:
            raise RestraintError(f"{path}: {exc}") from None


def as_restraint(value: Restraint | dict[str, Any] | str | os.PathLike) -> Restraint:
    """What a caller handed over as a restraint: a Restraint as it is, a mapping as a spec's content, a str or path as
    a spec file (never YAML text: the caller who holds text parses it and passes the mapping)."""
    if isinstance(value, Restraint):
        return value
    if isinstance(value, dict):
        return Restraint.from_dict(value)
    if isinstance(value, str | os.PathLike):
        return Restraint.load(value)
    raise RestraintError(f"a restraint is a Restraint, a spec mapping or a spec file's path, not a {type(value).__name__}")


def _units(raw: Any) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Units per layer, checked and sorted, with each layer's sort order (to carry aligned values along)."""
    if not isinstance(raw, dict) or not raw:
        raise RestraintError("'units' must be a non-empty mapping {layer: [unit, ...]}")
    units: dict[int, list[int]] = {}
    order: dict[int, list[int]] = {}
    for layer, ids in raw.items():
        layer_i = _layer(layer)
        if not isinstance(ids, (list, tuple)) or not ids:
            raise RestraintError(f"layer {layer_i}: units must be a non-empty list")
        bad = [u for u in ids if isinstance(u, bool) or not isinstance(u, int)]
        if bad:
            raise RestraintError(f"layer {layer_i}: units must be integers, got {bad[0]!r}")
        if len(set(ids)) != len(ids):
            dupes = sorted(u for u, n in Counter(ids).items() if n > 1)
            raise RestraintError(f"layer {layer_i}: duplicate units {dupes[:10]}{' ...' if len(dupes) > 10 else ''}")
        if layer_i < 0 or min(ids) < 0:
            raise RestraintError(f"layer {layer_i}: negative layer or unit index")
        order[layer_i] = sorted(range(len(ids)), key=ids.__getitem__)
        units[layer_i] = [ids[i] for i in order[layer_i]]
    return dict(sorted(units.items())), order


def _layer(key: Any) -> int:
    try:
        return int(key)
    except (TypeError, ValueError):
        raise RestraintError(f"layer key {key!r} is not an integer") from None


def _finite(values: Any, what: str) -> list[float]:
    if not isinstance(values, (list, tuple)) or not values:
        raise RestraintError(f"{what} must be a non-empty list of numbers")
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError):
        raise RestraintError(f"{what} must be numbers") from None
    if not all(math.isfinite(v) for v in out):
        raise RestraintError(f"{what} must be finite")
    return out


def _values(raw: Any, units: dict[int, list[int]], order: dict[int, list[int]]) -> dict[int, list[float]]:
    """A patch's constants per layer, one per unit, reordered as its units were sorted."""
    if not isinstance(raw, dict) or {_layer(k) for k in raw} != set(units):
        raise RestraintError(f"a patch needs 'values' for exactly the layers of its units ({sorted(units)})")
    values = {}
    for key, vals in raw.items():
        layer = _layer(key)
        vals = _finite(vals, f"layer {layer}: values")
        if len(vals) != len(units[layer]):
            raise RestraintError(f"layer {layer}: {len(vals)} values for {len(units[layer])} units")
        values[layer] = [vals[i] for i in order[layer]]
    return dict(sorted(values.items()))


def _directions(raw: Any) -> dict[int, list[float]]:
    """Per layer, the direction scaled to unit length (in float64: what the hook projects out is normalised once)."""
    if not isinstance(raw, dict) or not raw:
        raise RestraintError("a direction restraint needs 'directions': {layer: [a vector of the hook point's width]}")
    out = {}
    for key, vector in raw.items():
        layer = _layer(key)
        vector = _finite(vector, f"layer {layer}: the direction")
        norm = math.sqrt(math.fsum(v * v for v in vector))
        if layer < 0 or norm == 0:
            raise RestraintError(f"layer {layer}: a direction needs a layer >= 0 and a nonzero vector")
        out[layer] = [v / norm for v in vector]
    return dict(sorted(out.items()))
