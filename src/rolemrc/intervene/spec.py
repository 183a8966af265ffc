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
from typing import Any

import yaml

from rolemrc.core.artifacts import FORMATS, check_format, describe, identify
from rolemrc.core.errors import InputError, RolemrcError
from rolemrc.core.hooks import HOOK_POINTS
from rolemrc.core.io import read_yaml

PAPER_FACTOR = 1 - 1e-6   # the RoleMRC paper's restraint: scale the selected units by 1 - 1e-6


class RestraintError(RolemrcError, ValueError):
    """A restraint spec is malformed or does not fit the model."""



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
    """Units at one hook point, per layer, scaled by `factor` (the paper's 1 - 1e-6 by default)."""

    name: str
    hook: str
    units: dict[int, list[int]]
    factor: float = PAPER_FACTOR
    source: dict[str, Any] = field(default_factory=dict)
    # the model the units were selected on (its diff's or attribution's B model): name, fingerprint, fingerprint_of
    # ("directory": its files, "weights": its tensors; "" unknown), layers, width; {} for a spec made by hand
    model: dict[str, Any] = field(default_factory=dict)

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
        if not isinstance(self.units, dict) or not self.units:
            raise RestraintError("'units' must be a non-empty mapping {layer: [unit, ...]}")
        units: dict[int, list[int]] = {}
        for layer, ids in self.units.items():
            try:
                layer_i = int(layer)
            except (TypeError, ValueError):
                raise RestraintError(f"layer key {layer!r} is not an integer") from None
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
            units[layer_i] = sorted(ids)
        self.units = dict(sorted(units.items()))

    @property
    def num_units(self) -> int:
        return sum(len(v) for v in self.units.values())

    @property
    def digest(self) -> str:
        """A short hash of what the restraint does (hook, units, factor; not its name or source): the one identity
        that batches, caches and adapters key restraints by."""
        what = {"hook": self.hook, "factor": self.factor, "units": {str(k): v for k, v in sorted(self.units.items())}}
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]

    def check_shape(self, layers: int, width: int) -> None:
        """A RestraintError unless the spec fits a model of `layers` layers with `width` units at its hook point: every
        layer and unit in range, and that shape the one its units were selected on (where the spec records it)."""
        shape = (self.model.get("layers"), self.model.get("width"))
        if None not in shape and shape != (layers, width):
            raise RestraintError(f"restraint {self.name!r} was selected on {self.model.get('name') or 'a model'} with "
                                 f"{shape[0]} layers of {shape[1]} {self.hook} units; this model has {layers} of {width}")
        for layer, ids in self.units.items():
            if layer >= layers:
                raise RestraintError(f"restraint {self.name!r}: layer {layer} out of range (model has {layers} layers)")
            if ids[-1] >= width:
                raise RestraintError(f"restraint {self.name!r}: unit {ids[-1]} in layer {layer} out of range "
                                     f"({self.hook} has width {width})")

    def summary(self) -> dict[str, Any]:
        """What a person reads: name, hook, factor, digest, unit counts per layer (the unit ids are in the spec) and,
        for a selected spec, the share of all units at the hook point and units per layer (min, median, max)."""
        spread = (self.source.get("coverage") or {}).get("per_layer")
        return {"name": self.name, "hook": self.hook, "factor": self.factor, "digest": self.digest,
                "units": self.num_units, "per_layer": {int(k): len(v) for k, v in sorted(self.units.items())},
                **({"share": self.source["coverage"]["share"],
                    "units_per_layer": {k: spread[k] for k in ("min", "median", "max")}} if spread else {})}

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "hook": self.hook, "factor": self.factor,
               "units": {int(k): list(v) for k, v in self.units.items()}}
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
        unknown = set(data) - {"name", "hook", "factor", "units", "source", "model", "kind", "format"}
        if unknown:
            raise RestraintError(f"unknown spec field(s) {sorted(unknown)}")
        missing = {"name", "hook", "units"} - set(data)
        if missing:
            raise RestraintError(f"spec is missing {sorted(missing)}")
        return cls(name=data["name"], hook=data["hook"], units=data["units"],
                   factor=data.get("factor", PAPER_FACTOR), source=data.get("source") or {}, model=data.get("model") or {})

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
