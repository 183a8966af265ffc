"""Training data: RoleMRC records -> trl datasets, with bad records skipped and counted.

Record kinds (docs/ARCHITECTURE.md "Records"): SFT `conversations`, preference pair
`prompt`/`chosen`/`rejected`, test `question`/`reference`, profile `text`, MRC triplet
`passages`/`question`/`answer`. Roles may be capitalised (`User`), as in the release. SFT and pair
records may use the aliases `core.records` accepts (`messages`, a plain-string `prompt`, `answer`, ...);
the data report says which fields each file used.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolemrc.core.artifacts import JSONL_INPUT, expect
from rolemrc.core.errors import InputError, RolemrcError
from rolemrc.core.io import JsonlError, file_fingerprint, iter_jsonl
from rolemrc.core.records import (
    Fields,
    Kind,
    RecordError,
    announce_fields,
    merge_fields,
    normalize_record,
    normalize_turns,
    reply_text,
)


class DataError(RolemrcError, ValueError):
    """The training data cannot be used (missing, unreadable, empty, or too many bad records)."""


class BadRecord(RolemrcError, ValueError):
    """One record is unusable: `reason` is what it is counted under, `detail` says more."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason, self.detail = reason, detail

    @classmethod
    def of(cls, exc: RecordError) -> BadRecord:
        return cls(exc.reason, str(exc).removeprefix("record: "))


@dataclass
class DataReport:
    """Kept and skipped records per source file, skips counted by reason."""

    kept: Counter = field(default_factory=Counter)
    skipped: dict[str, Counter] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)  # reason -> first file:line seen (and detail)
    fields: dict[str, Counter] = field(default_factory=dict)  # source -> Counter of core.records.Fields

    def keep(self, source: str, fields: Fields | None = None) -> None:
        self.kept[source] += 1
        if fields is not None:
            self.fields.setdefault(source, Counter())[fields] += 1

    def fields_used(self, source: str) -> dict[str, str]:
        return merge_fields(self.fields.get(source, ()))

    def skip(self, source: str, lineno: int, reason: str, detail: str = "") -> None:
        self.skipped.setdefault(source, Counter())[reason] += 1
        self.examples.setdefault(reason, f"{source}:{lineno}" + (f", {detail}" if detail else ""))

    @property
    def total_kept(self) -> int:
        return sum(self.kept.values())

    @property
    def total_skipped(self) -> int:
        return sum(sum(c.values()) for c in self.skipped.values())

    def reasons(self) -> Counter:
        out: Counter = Counter()
        for counts in self.skipped.values():
            out.update(counts)
        return out

    def check(self, max_bad_share: float, what: str) -> None:
        """Raise DataError when nothing is usable or the bad share exceeds `max_bad_share`."""
        total = self.total_kept + self.total_skipped
        if self.total_kept == 0:
            raise DataError(f"no usable {what} records ({self.summary()})")
        share = self.total_skipped / total
        if share > max_bad_share:
            raise DataError(f"{self.total_skipped} of {total} {what} records are bad ({share:.1%} > max_bad_share "
                            f"{max_bad_share:.1%}): {self.summary()}")

    def summary(self) -> str:
        reasons = "; ".join(f"{reason}: {n} (first at {self.examples[reason]})"
                            for reason, n in self.reasons().most_common())
        return f"kept {self.total_kept}, skipped {self.total_skipped}" + (f" [{reasons}]" if reasons else "")

    def as_dict(self) -> dict[str, Any]:
        return {"kept": self.total_kept, "skipped": self.total_skipped, "reasons": dict(self.reasons()),
                "per_file": {src: {"kept": self.kept.get(src, 0), "skipped": dict(self.skipped.get(src, {}))}
                             for src in sorted(set(self.kept) | set(self.skipped))},
                "fields": {src: self.fields_used(src) for src in sorted(self.fields)}}


def jsonl_files(paths: list[str | os.PathLike]) -> list[Path]:
    """Files named directly, plus the `*.jsonl` files directly inside named directories."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        wanted = "training data is a JSONL file of records or a folder of them (e.g. from `rolemrc datagen run`)"
        try:
            expect(path, ("datagen", "folder", *JSONL_INPUT), wanted)
        except InputError as exc:
            raise DataError(str(exc)) from None
        if path.is_dir():
            found = sorted(path.glob("*.jsonl"))
            if not found:
                raise DataError(f"{path}: folder holds no .jsonl files; {wanted}")
            out.extend(found)
        else:
            out.append(path)
    return out


def fingerprints(files: list[Path]) -> dict[str, str]:
    return {str(f): file_fingerprint(f) for f in files}


def nonempty_text(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise BadRecord(f"empty or missing {name}")
    return value


def record_turns(value: Any) -> list[dict[str, str]]:
    try:
        return normalize_turns(value)
    except RecordError as exc:
        raise BadRecord.of(exc) from None


def canonical(record: dict[str, Any], kind: Kind, lineno: int | None = None) -> tuple[dict[str, Any], Fields]:
    """core.records.normalize_record, a bad record raised as BadRecord."""
    try:
        return normalize_record(record, lineno, kind)
    except RecordError as exc:
        raise BadRecord.of(exc) from None


@dataclass(frozen=True)
class Converter:
    """Record kind -> trl example; called with a raw (aliased) or canonical record."""

    kind: Kind
    build: Callable[[dict[str, Any]], dict[str, Any]]

    def __call__(self, record: dict[str, Any]) -> dict[str, Any]:
        return self.build(canonical(record, self.kind)[0])


def _sft(record: dict[str, Any]) -> dict[str, Any]:
    """A trl conversational example `{"messages": turns}` from a canonical SFT record."""
    turns = record["conversations"]
    replies = [t for t in turns if t["role"] == "assistant"]
    if not replies:
        raise BadRecord("no assistant turn")
    for reply in replies:
        nonempty_text(reply["content"], "assistant reply")
    return {"messages": turns}


def _reply(value: Any, name: str) -> list[dict[str, str]]:
    """A pair's chosen/rejected side: a string, or turns ending in an assistant turn."""
    if value is None:
        raise BadRecord("missing chosen/rejected")
    try:
        text = reply_text(value, name)
    except RecordError as exc:
        raise BadRecord.of(exc) from None
    return [{"role": "assistant", "content": nonempty_text(text, name)}]


def _pair(record: dict[str, Any]) -> dict[str, Any]:
    """A trl conversational preference example from a canonical pair record."""
    prompt = record["prompt"]
    if prompt[-1]["role"] != "user":
        raise BadRecord("prompt does not end with a user turn")
    chosen, rejected = _reply(record.get("chosen"), "chosen"), _reply(record.get("rejected"), "rejected")
    if chosen[0]["content"].strip() == rejected[0]["content"].strip():
        raise BadRecord("chosen equals rejected")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


sft_example = Converter("sft", _sft)
pair_example = Converter("pair", _pair)


def scan(files: list[Path], handle: Callable[[dict[str, Any]], Any], report: DataReport, kind: Kind | None = None) -> None:
    """Call `handle` on each record (made canonical first when `kind` is given, the fields used counted and
    noted on stderr); records rejected with BadRecord are skipped and counted, a line that is not a JSON
    object is a DataError."""
    try:
        for path in files:
            for lineno, record in iter_jsonl(path):
                try:
                    record, fields = canonical(record, kind, lineno) if kind else (record, None)
                    handle(record)
                except BadRecord as exc:
                    report.skip(str(path), lineno, exc.reason, exc.detail)
                else:
                    report.keep(str(path), fields)
            if kind:
                announce_fields(path, kind, report.fields_used(str(path)))
    except JsonlError as exc:
        raise DataError(str(exc)) from None


def load_examples(files: list[Path], convert: Callable[[dict[str, Any]], dict], report: DataReport) -> list[dict]:
    """The examples `convert` makes of the records it accepts (a Converter's fields are counted)."""
    out: list[dict] = []
    scan(files, lambda record: out.append(convert(record)), report, getattr(convert, "kind", None))
    return out


def parse_mix(spec: str) -> tuple[Path, float]:
    """`PATH:RATIO` -> (path, ratio); RATIO > 0 is relative to the size of the main data."""
    path, sep, ratio = spec.rpartition(":")
    try:
        value = float(ratio)
    except ValueError:
        value = -1.0
    if not sep or not path or value <= 0:
        raise DataError(f"--mix expects PATH:RATIO with RATIO > 0 (e.g. extra.jsonl:0.3), got {spec!r}")
    return Path(path), value


def mix_in(main: list[dict[str, Any]], extra: list[dict[str, Any]], ratio: float, seed: int) -> list[dict[str, Any]]:
    """Draw round(ratio * len(main)) examples from `extra` (a seeded shuffle, repeated if it is short)."""
    if not extra:
        return []
    want = round(ratio * len(main))
    rng = random.Random(seed)
    drawn: list[dict[str, Any]] = []
    while len(drawn) < want:
        order = list(extra)
        rng.shuffle(order)
        drawn.extend(order[: want - len(drawn)])
    return drawn


def sft_examples(data: list[str], mix: list[str], seed: int, report: DataReport) -> tuple[list[dict], dict[str, Any]]:
    """SFT examples of `data` plus the `mix` shares, and a description of the mixture."""
    main = load_examples(jsonl_files(data), sft_example, report)
    examples, mixture = list(main), {"main": len(main)}
    for k, spec in enumerate(mix):
        path, ratio = parse_mix(spec)
        extra = load_examples(jsonl_files([path]), sft_example, report)
        drawn = mix_in(main, extra, ratio, seed + k + 1)
        mixture[str(path)] = {"ratio": ratio, "available": len(extra), "drawn": len(drawn)}
        examples.extend(drawn)
    random.Random(seed).shuffle(examples)
    return examples, mixture
