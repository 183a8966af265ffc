"""The install ships every folder of the package, and the build says nothing about missing ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
NOT_SHIPPED = {"tests", "notebooks", "scripts", "docs", "vllm_plugin"}   # vllm_plugin: a package of its own (docs/vllm-plugin.md)


def shipped_folders() -> set[str]:
    """Dotted names of every folder holding tracked Python or data files (tests, docs, notebooks excluded)."""
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT).stdout.split()
    found = set()
    for rel in map(Path, tracked):
        if rel.parts[0] in NOT_SHIPPED or rel.parts[0].startswith("."):
            continue
        if len(rel.parts) > 1 or rel.suffix == ".py":
            found.add(".".join(("rolemrc", *rel.parts[:-1])))
    return found


def test_every_folder_is_a_listed_package():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert shipped_folders() - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - shipped_folders() == set(), "these listed packages have no folder"


@pytest.mark.slow
def test_wheel_build_is_quiet_and_ships_data(tmp_path):
    """`pip wheel` warns about nothing, and the wheel carries the data folders."""
    import zipfile

    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                           str(tmp_path), str(ROOT)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    log = proc.stdout + proc.stderr
    assert "absent from the `packages` configuration" not in log and "BuildBackendWarning" not in log, log
    names = zipfile.ZipFile(next(tmp_path.glob("rolemrc-*.whl"))).namelist()
    for data in ("rolemrc/train/profiles/tiny.yaml", "rolemrc/datagen/data/mrc.jsonl",
                 "rolemrc/probe/templates/explorer.html"):
        assert data in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names   # the Apache-2.0 text


def test_tree_is_clean_under_ruff():
    """`make lint` passes: the tree stays clean under the project's ruff settings."""
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:]
