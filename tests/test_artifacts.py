"""Artifacts say what they are: `identify` tells every kind apart (rolemrc's own, as rolemrc writes them, and foreign
ones), every file rolemrc writes carries its kind and format version, every reader refuses a newer format with
both versions named, and a file without its stamp is not that kind."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.artifacts import FORMATS, HAND_WRITTEN, KINDS, describe, identify
from rolemrc.core.errors import EXIT_INPUT

IDENTIFIED = {   # artifact (conftest's `artifacts`) -> what identify() says it is
    "model": "model", "records": "records", "pairs": "records", "sft-records": "records", "responses": "responses",
    "probe": "probe", "paired-probe": "paired-probe", "attribution": "attribution", "diff": "diff",
    "restraint": "restraint", "peft-adapter": "peft-adapter", "eval-run": "eval-run", "sweep": "sweep", "baked-arms": "baked-arms", "calibration": "calibration", "gguf": "gguf",
    "sqlite": "sqlite", "serve-config": "serve-config", "train-config": "train-config", "known-units": "json", "personas": "records",
    "mrc": "records", "missing": "missing", "empty-file": "empty-file", "empty-folder": "empty-folder",
    "folder": "folder", "binary": "binary", "non-utf8": "non-utf8",
}


def test_identify_tells_every_kind_apart(artifacts):
    assert set(IDENTIFIED) == set(artifacts)
    found = {name: identify(path) for name, path in artifacts.items()}
    assert found == IDENTIFIED
    assert identify(artifacts["diff"] / "diff.safetensors") == "diff-file"
    assert describe(artifacts["diff"]) == "a diff folder (from `rolemrc probe diff`)"
    assert set(found.values()) <= set(KINDS)


def stamped(path: Path) -> dict:
    """The kind and format a file says it is."""
    if path.suffix == ".safetensors":
        with safe_open(str(path), "pt") as fh:
            meta = fh.metadata()
    else:
        meta = yaml.safe_load(path.read_text())
    return {"kind": meta.get("kind"), "format": str(meta.get("format"))}


WRITTEN = {   # kind -> the file of the artifact that carries the stamp
    "probe": lambda a: a["probe"], "paired-probe": lambda a: a["paired-probe"], "attribution": lambda a: a["attribution"],
    "diff": lambda a: a["diff"] / "diff.safetensors", "restraint": lambda a: a["restraint"],
    "eval-run": lambda a: a["eval-run"] / "report.json", "sweep": lambda a: a["sweep"] / "sweep.json",
    "baked-arms": lambda a: a["baked-arms"] / "models.yaml",
}


def test_every_versioned_file_says_what_it_is(artifacts):
    assert set(WRITTEN) == set(FORMATS)
    for kind, where in WRITTEN.items():
        assert stamped(where(artifacts)) == {"kind": kind, "format": str(FORMATS[kind])}, kind


def rewrite_stamp(path: Path, change: Callable[[dict], dict]) -> None:
    """Rewrite a stamped file with `change` applied to its metadata or document (everything else as it was)."""
    if path.suffix == ".safetensors":
        with safe_open(str(path), "pt") as fh:
            meta, tensors = fh.metadata(), {name: fh.get_tensor(name) for name in fh.keys()}  # noqa: SIM118 (safe_open is not iterable)
        save_file(tensors, str(path), metadata=change(meta))
    else:
        path.write_text(json.dumps(change(yaml.safe_load(path.read_text()))))


def newer(meta: dict) -> dict:
    """The stamp of format FORMATS + 1."""
    return {**meta, "format": type(meta["format"])(int(meta["format"]) + 1)}


def unstamped(meta: dict) -> dict:
    return {key: value for key, value in meta.items() if key not in ("kind", "format")}


READERS = {   # kind -> a command line that reads it ({x}: the newer copy, {a}: an artifact, {out}: a fresh folder)
    "probe": ["probe", "diff", "{x}", "{probe}", "--out", "{out}"],
    "paired-probe": ["probe", "diff", "{x}", "--out", "{out}"],
    "attribution": ["intervene", "select", "--diff", "{x}", "--method", "attribution", "--dimension", "role_style",
                    "--top-k", "2", "--factor", "0", "--out", "{out}/s.yaml"],
    "diff": ["intervene", "select", "--diff", "{x}", "--dimension", "role_style", "--method", "frequency", "--top-k", "2",
             "--factor", "0", "--out", "{out}/s.yaml"],
    "restraint": ["intervene", "lora", "--model", "{model}", "--restraint", "{x}", "--out", "{out}"],
    "eval-run": ["eval", "report", "{x}", "--out", "{out}"],
    "sweep": ["ab", "create", "--from-sweep", "{x}", "--base-url", "http://127.0.0.1:9/v1"],
    "baked-arms": ["ab", "create", "--from-sweep", "{sweep}", "--cells", "best:1", "--baked", "{x}", "--base-url",
                   "http://127.0.0.1:9/v1"],
}


def refusal(artifacts: dict, kind: str, tmp_path: Path, change: Callable[[dict], dict]) -> tuple[Path, str]:
    """(the copy, its one error line) of the reader of `kind` given a copy of its artifact whose stamp `change`
    rewrote; the reader exits with EXIT_INPUT and writes nothing."""
    source = artifacts[kind]
    copy = tmp_path / source.name
    (shutil.copytree if source.is_dir() else shutil.copy)(source, copy)
    rewrite_stamp(WRITTEN[kind]({kind: copy}), change)
    out = tmp_path / "out"
    args = [str(copy) if t == "{x}" else str(out) + t[5:] if t.startswith("{out}") else
            str(artifacts[t[1:-1]]) if t.startswith("{") else t for t in READERS[kind]]
    result = CliRunner().invoke(app, args)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == EXIT_INPUT and len(errors) == 1, result.output
    assert not out.exists()
    return copy, errors[0]


@pytest.mark.parametrize("kind", sorted(READERS))
def test_a_newer_format_is_refused_with_both_versions(artifacts, kind, tmp_path):
    assert set(READERS) == set(FORMATS)
    _, error = refusal(artifacts, kind, tmp_path, newer)
    assert f"format {FORMATS[kind] + 1}, written by a newer rolemrc; this one reads format {FORMATS[kind]}" in error


@pytest.mark.parametrize("kind", sorted(set(READERS) - set(HAND_WRITTEN)))
def test_a_file_without_its_stamp_is_not_that_kind(artifacts, kind, tmp_path):
    copy, error = refusal(artifacts, kind, tmp_path, unstamped)
    assert str(copy) in error and ("is a safetensors weights file; expected" in error or "no format stamp, so not" in error)
