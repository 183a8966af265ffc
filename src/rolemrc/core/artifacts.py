"""What a path holds, in a user's words: the one place that tells rolemrc's artifacts (and the foreign files people
hand it by mistake) apart, so a reader that gets the wrong thing says what it got and what it wanted in one line.

`identify(path)` looks cheaply (names in a folder, a file's first bytes, a safetensors header, a JSON or YAML
document's keys, a JSONL file's first record) and never imports torch; `expect(path, kinds, ...)` is what readers
call before they read anything.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from rolemrc.core.errors import InputError

SNIFF = 1 << 16   # bytes read to tell text from binary


@dataclass(frozen=True)
class Kind:
    name: str     # a noun phrase: "diff folder"
    origin: str   # what makes it: "`rolemrc probe diff`" ("" for things rolemrc does not write)

    def __str__(self) -> str:
        article = "an" if self.name[0] in "aeiou" else "a"
        return f"{article} {self.name}" + (f" (from {self.origin})" if self.origin else "")


KINDS: dict[str, Kind] = {key: Kind(*value) for key, value in {
    "missing": ("missing path", ""),
    "empty-file": ("empty file", ""),
    "empty-folder": ("empty folder", ""),
    "folder": ("folder", ""),
    "binary": ("binary file", ""),
    "non-utf8": ("non-UTF-8 text file", ""),
    "text": ("text file", ""),
    "records": ("JSONL file of records", "`rolemrc datagen run` or your own data"),
    "responses": ("responses JSONL", "`rolemrc eval generate`"),
    "probe": ("probe file", "`rolemrc probe collect`"),
    "paired-probe": ("paired probe file", "`rolemrc probe collect` with two --model"),
    "attribution": ("attribution file", "`rolemrc probe attribute`"),
    "diff": ("diff folder", "`rolemrc probe diff`"),
    "diff-file": ("diff file", "`rolemrc probe diff`"),
    "restraint": ("restraint spec", "`rolemrc intervene select`"),
    "eval-run": ("eval run folder", "`rolemrc eval run` or `eval score`"),
    "sweep": ("sweep folder", "`rolemrc sweep run`"),
    "frontier": ("frontier folder", "`rolemrc sweep frontier`"),
    "baked-arms": ("baked arms folder", "`rolemrc ab bake`"),
    "calibration": ("calibration folder", "`rolemrc organism calibrate`"),
    "organisms": ("organisms folder", "`rolemrc organism build`"),
    "datagen": ("datagen output folder", "`rolemrc datagen run`"),
    "model": ("Hugging Face model directory", ""),
    "peft-adapter": ("PEFT adapter folder", "`rolemrc intervene lora` or peft"),
    "safetensors": ("safetensors weights file", ""),
    "gguf": ("GGUF file", ""),
    "wheel": ("Python wheel", "pip"),
    "parquet": ("Parquet file", ""),
    "sqlite": ("SQLite database", "`rolemrc serve`'s A/B log"),
    "serve-config": ("serve config", ""),
    "train-config": ("training config", ""),
    "json": ("JSON file", ""),
    "yaml": ("YAML file", ""),
}.items()}

FOLDER_MARKS = (   # (kind, files that make a folder that kind), first match wins
    ("model", ("config.json",)),
    ("peft-adapter", ("adapter_config.json",)),
    ("diff", ("diff.safetensors",)),
    ("eval-run", ("report.json", "responses.jsonl")),
    ("sweep", ("plan.json",)),
    ("frontier", ("points.json",)),
    ("baked-arms", ("models.yaml",)),
    ("calibration", ("calibration.json",)),
    ("organisms", ("heldout.jsonl", "replies.jsonl")),
    ("datagen", ("sft.jsonl", "pairs.jsonl", "test.jsonl")),
)
RECORD_KEYS = (   # (kind, keys of a JSONL record that make the file that kind), first match wins
    ("responses", {"response"}),
    ("records", {"chosen"}), ("records", {"question"}), ("records", {"conversations"}), ("records", {"messages"}),
    ("records", {"prompt"}), ("records", {"persona"}), ("records", {"passages"}),
)
# top-level keys of a training config (train/config.py): stage sections, trainer arguments, common settings
TRAIN_KEYS = {"base", "sft", "dpo", "trl", "batch_size", "effective_batch_size", "lora"}


def identify(path: str | os.PathLike) -> str:
    """The key in KINDS of what `path` holds (cheap: never reads more than a header or a first record)."""
    path = Path(path)
    if not path.exists():
        return "missing"
    if path.is_dir():
        names = {p.name for p in path.iterdir()}
        if not names:
            return "empty-folder"
        return next((kind for kind, marks in FOLDER_MARKS if set(marks) <= names), "folder")
    with path.open("rb") as fh:
        head = fh.read(SNIFF)
    if not head:
        return "empty-file"
    if head.startswith(b"GGUF"):
        return "gguf"
    if head.startswith(b"SQLite format 3\x00"):
        return "sqlite"
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(b"PK\x03\x04") and path.suffix == ".whl":
        return "wheel"
    if (header := safetensors_header(path, head)) is not None:
        return tensor_kind(header.get("__metadata__") or {})
    if b"\x00" in head:
        return "binary"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:   # not a character cut by the sniff's end
            return "non-utf8"
        text = head[:exc.start].decode("utf-8")
    return text_kind(path, text)


def safetensors_header(path: Path, head: bytes) -> dict | None:
    """The JSON header of a safetensors file (its 8-byte length, then tensor name -> dtype/shape/offsets, and
    `__metadata__`), or None if `head` does not start one."""
    if len(head) < 10:
        return None
    (size,) = struct.unpack("<Q", head[:8])
    if not 2 <= size <= 100_000_000 or head[8:9] != b"{":
        return None
    with path.open("rb") as fh:
        fh.seek(8)
        raw = fh.read(size)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return header if isinstance(header, dict) else None


def tensor_kind(meta: dict[str, str]) -> str:
    """The kind of a safetensors file by its stamp (an unstamped one holds weights, as far as rolemrc knows)."""
    stamped = meta.get("kind")
    if stamped in ("probe", "paired-probe", "attribution"):
        return stamped
    return "diff-file" if stamped == "diff" else "safetensors"


def text_kind(path: Path, text: str) -> str:
    first = next((line for line in text.splitlines() if line.strip()), "")
    if path.suffix == ".jsonl" or (first.startswith("{") and first.rstrip().endswith("}") and "\n" in text.strip()):
        try:
            record = json.loads(first)
        except ValueError:
            return "text"
        if isinstance(record, dict):
            return next((kind for kind, keys in RECORD_KEYS if keys <= set(record)), "records")
        return "text"
    if path.suffix in (".json", ".yaml", ".yml"):
        return document_kind(path)
    return "text"


def document_kind(path: Path) -> str:
    """Kind of a JSON or YAML document by its top-level keys."""
    import yaml

    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.suffix == ".json" else yaml.safe_load(
            path.read_text(encoding="utf-8"))
    except (ValueError, yaml.YAMLError, UnicodeDecodeError):
        return "json" if path.suffix == ".json" else "yaml"
    if isinstance(data, dict):
        keys = set(data)
        if data.get("kind") in KINDS:   # a file that says what it is
            return data["kind"]
        if {"hook", "units"} <= keys:
            return "restraint"
        if "models" in keys and isinstance(data["models"], (list, dict)):
            return "serve-config"
        if keys & TRAIN_KEYS:
            return "train-config"
        if "peft_type" in keys:
            return "peft-adapter"
    return "json" if path.suffix == ".json" else "yaml"


# The format version of each kind this rolemrc writes, the only one it reads. diff 2: tests named by code.
FORMATS = {"probe": 2, "paired-probe": 2, "attribution": 1, "diff": 2, "restraint": 1, "eval-run": 1, "sweep": 2,
           "baked-arms": 1}
HAND_WRITTEN = ("restraint",)   # kinds a person may write: without a "format" they are of the current one


def stamp(kind: str) -> dict[str, str]:
    """The metadata that says what a written file is: {"kind", "format"} (strings, as safetensors metadata wants)."""
    return {"kind": kind, "format": str(FORMATS[kind])}


def check_format(path: str | os.PathLike | None, meta: dict, kind: str) -> None:
    """An InputError for a `kind` file of another format than this rolemrc reads, with both versions named and what
    to do (and the file, when `path` is given); one without a format stamp is no `kind` rolemrc wrote (but for
    HAND_WRITTEN kinds)."""
    where = f"{path}: " if path is not None else ""
    if "format" not in meta:
        if kind in HAND_WRITTEN:
            return
        raise InputError(f"{where}no format stamp, so not {KINDS[kind]}")
    version = meta["format"]
    try:
        version = int(version)
    except (TypeError, ValueError):
        raise InputError(f"{where}unreadable format version {version!r} of {KINDS[kind]}") from None
    if version > FORMATS[kind]:
        raise InputError(f"{where}{KINDS[kind].name} format {version}, written by a newer rolemrc; this one reads "
                         f"format {FORMATS[kind]} (upgrade rolemrc)")
    if version < FORMATS[kind]:
        raise InputError(f"{where}{KINDS[kind].name} format {version}, written by an earlier rolemrc; this one reads "
                         f"format {FORMATS[kind]} (rerun {KINDS[kind].origin} to write it again)")


def describe(path: str | os.PathLike) -> str:
    """What `path` holds, as a phrase: "a diff folder (from `rolemrc probe diff`)"."""
    return str(KINDS[identify(path)])


# Contents no look can place (plain text, a JSON or YAML document of no known kind, bytes): a reader that accepts
# these lets its own parser say what is wrong, with line and column.
GENERIC = ("text", "json", "yaml", "binary", "non-utf8")
JSONL_INPUT = ("records", "responses", "text", "json", "yaml", "non-utf8")   # what a reader of records parses (the
# parser names the line and column); a binary file is refused by its kind


def expect(path: str | os.PathLike, kinds: str | tuple[str, ...], wanted: str) -> Path:
    """`path` as a Path when it holds one of `kinds` (keys of KINDS), else an InputError saying what it is, then
    `wanted` ("`rolemrc probe diff` wants probe files from `rolemrc probe collect`")."""
    kinds = (kinds,) if isinstance(kinds, str) else kinds
    found = identify(path)
    if found == "missing" and "missing" not in kinds:
        raise InputError(f"{path}: no such file or folder; {wanted}")
    if found not in kinds:
        raise InputError(f"{path} is {KINDS[found]}; {wanted}")
    return Path(path)
