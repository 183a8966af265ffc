"""The documentation runs and builds: docs/python.md and the package's docstring example run as doctests; every
sketch in a module docstring or the README defines or imports each name it uses; the mkdocs site builds with
--strict (no broken link or anchor), README.md as its home page."""

from __future__ import annotations

import ast
import builtins
import doctest
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import rolemrc

ROOT = Path(__file__).resolve().parents[1]
SKIPPED = {"tests", "notebooks", "scripts", "docs", "build", "dist", "runs", "site"}


def test_the_python_page_runs_as_a_doctest():
    result = doctest.testfile(str(ROOT / "docs" / "python.md"), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted >= 20, result


def test_the_package_docstring_runs_as_a_doctest():
    result = doctest.testmod(rolemrc, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted >= 6, result


def sketches(text: str) -> list[str]:
    """Code sketches in prose: ```python blocks, and runs of lines indented by 4 spaces that read as code (they parse,
    or they import or call rolemrc; an indented formula is prose), doctests aside."""
    found = [m.group(1) for m in re.finditer(r"```python\n(.*?)```", text, re.S) if ">>>" not in m.group(1)]
    for block in re.findall(r"(?:^|\n)\n((?: {4}\S.*\n?(?:(?: {4,}.*)?\n?)*)+)", text):
        code = textwrap.dedent(block)
        if ">>>" in code or not re.search(r"\w\(", code):
            continue
        try:
            ast.parse(code)
        except SyntaxError:
            if "import " not in code and "rolemrc." not in code:
                continue
        found.append(code)
    return found


def undefined(code: str) -> set[str]:
    tree = ast.parse(code)
    bound, used = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, ast.Store) else used).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return used - bound


def test_every_sketch_imports_what_it_uses():
    tracked = subprocess.run(["git", "ls-files", "*.py"], capture_output=True, text=True, cwd=ROOT).stdout.split()
    sources = {p: ast.get_docstring(ast.parse((ROOT / p).read_text())) or "" for p in tracked
               if Path(p).parts[0] not in SKIPPED}
    sources["README.md"] = (ROOT / "README.md").read_text()
    checked, wrong = 0, []
    for where, text in sources.items():
        for code in sketches(text):
            try:
                missing = undefined(code)
            except SyntaxError as exc:
                wrong.append(f"{where}: not Python ({exc.msg}): {code[:80]!r}")
                continue
            checked += 1
            wrong += [f"{where}: {name}" for name in sorted(missing)]
    assert checked >= 8
    assert not wrong, wrong


@pytest.mark.slow
def test_the_site_builds_strictly_with_the_readme_as_home(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    home = (tmp_path / "site" / "index.html").read_text()
    assert "Quickstart: your own SFT and DPO models" in home and 'href="python/"' in home
    assert (tmp_path / "site" / "calibration" / "index.html").is_file()
