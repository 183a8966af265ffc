"""Reading a selector's input: a diff or an attribution file (or its loaded object), which file it is, its hook
point, and the models it records (the diff's A and B sides, an attribution's SFT and DPO models)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rolemrc.core.artifacts import expect
from rolemrc.core.errors import InputError

IN_MEMORY = "in memory"   # a source's origin when it was handed over as an object


def role_meta(meta: dict[str, str], role: str = "dpo") -> dict[str, str]:
    """An attribution's metadata of its DPO or SFT model (its `models`: by role, or a list in the order sft, dpo)."""
    models = json.loads(meta.get("models") or "{}")
    found = models.get(role) if isinstance(models, dict) else (models[-1 if role == "dpo" else 0] if models else None)
    return found if isinstance(found, dict) else {}


def model_of(meta: dict[str, str], prefix: str = "") -> dict[str, str]:
    """The identity of a probed model as a restraint spec records it (from a probe's or a diff's metadata, the
    diff's keys with prefix "b_"), with the dtype it was probed at where recorded; {} when the metadata has no
    fingerprint."""
    if not meta.get(f"{prefix}model_fingerprint"):
        return {}
    name = meta.get(f"{prefix}model") or meta.get(prefix.rstrip("_"), "")   # diffs before names: the side's label
    return {"name": name, "fingerprint": meta[f"{prefix}model_fingerprint"],
            "fingerprint_of": meta.get(f"{prefix}model_fingerprint_of", ""),
            **({"dtype": meta[f"{prefix}dtype"]} if meta.get(f"{prefix}dtype") else {})}


def input_file(path: str | os.PathLike) -> Path:
    """A selector's input file: a diff directory's diff.safetensors, else the path itself."""
    from rolemrc.probe.diff import DIFF_FILE

    path = Path(path)
    return path / DIFF_FILE if path.is_dir() else path


def input_hook(path: str | os.PathLike) -> str:
    """The hook point a selector's input (a diff, or an attribution file) was measured at."""
    from rolemrc.probe.counts import read_tensors

    expect(path, ("diff", "diff-file", "attribution"), "a selector reads a diff folder (from `rolemrc probe diff`) or "
           "an attribution file (from `rolemrc probe attribute`)")
    return read_tensors(input_file(path), "diff or attribution file", missing="no such diff or attribution file")[0]["hook"]


def units_of(data: dict[str, list[int]]) -> dict[int, list[int]]:
    """Units (layer -> unit indices) from their JSON form (keys are strings): a known-units file, organism.json."""
    return {int(layer): [int(u) for u in units] for layer, units in data.items()}


def read_units(path: str | os.PathLike) -> dict[int, list[int]]:
    """S from known_units.json (layer -> units); anything else is an InputError naming the file."""
    wanted = "--known-units wants a units organism's known_units.json (from `rolemrc organism build`)"
    text = expect(path, "json", wanted).read_text()
    try:
        units = units_of(json.loads(text))
    except (ValueError, AttributeError, TypeError) as err:
        raise InputError(f"{path}: not layer -> [unit, ...] ({err}); {wanted}") from None
    if not units or not all(units.values()) or min(units) < 0 or min(min(u) for u in units.values()) < 0:
        raise InputError(f"{path}: no units, or a negative layer or unit; {wanted}")
    return units
