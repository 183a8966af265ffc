"""The wheel ships exactly the files git tracks under src/rolemrc (code and data), its licence and metadata; building
it writes nothing into the checkout; the tree is clean under ruff."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> list[str]:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT, check=True).stdout.splitlines()


def tree_state() -> list[str]:
    """Every untracked or ignored path of the checkout but Python's byte-code caches (imports write those) and
    test-artifacts/ (where other tests, running meanwhile on other workers, leave what CI keeps)."""
    return [line for line in git("status", "--porcelain", "--ignored")
            if "__pycache__" not in line and not line.endswith(" test-artifacts/")]


@pytest.mark.slow
def test_the_wheel_holds_the_package_and_the_build_writes_nothing_here(tmp_path):
    before = tree_state()
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                           str(tmp_path), str(ROOT)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in (proc.stdout + proc.stderr).lower().replace("warning: location", ""), proc.stdout + proc.stderr
    names = zipfile.ZipFile(next(tmp_path.glob("rolemrc-*.whl"))).namelist()
    shipped = {n for n in names if not n.startswith("rolemrc-")}
    tracked = {p.removeprefix("src/") for p in git("ls-files", "src/rolemrc")}
    assert shipped == tracked
    assert "rolemrc/probe/templates/explorer.html" in shipped and "rolemrc/train/profiles/tiny.yaml" in shipped
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names   # the Apache-2.0 text
    assert any(n.endswith(".dist-info/entry_points.txt") for n in names), names
    assert tree_state() == before, "the build wrote into the tree"


def test_tree_is_clean_under_ruff():
    """`make lint` passes: the tree stays clean under the project's ruff settings."""
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:]
