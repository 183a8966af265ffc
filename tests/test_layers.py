"""The layer order of rolemrc's packages, checked against every import in the source: module-level or inside a
function, `importlib.import_module("rolemrc...")`, and "rolemrc.module:Name" strings that registries import on first use.
An import may go to the same package or to a lower layer, never sideways or up, and no module may import itself back
through a circle. docs/ARCHITECTURE.md shows this table (a test keeps the two equal)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "rolemrc"

# Lowest first. A package may import from its own package and from packages in lower rows only; packages in one row
# are siblings and import nothing of each other. `rolemrc` itself (the facade re-exporting the method's verbs) and
# `rolemrc.cli` are on top.
LAYERS: list[tuple[str, ...]] = [
    ("core",),
    ("models", "datagen", "train", "probe"),
    ("intervene",),
    ("generate",),
    ("eval", "serve"),
    ("sweep",),
    ("ab", "organism"),
    ("demo", "bench"),
    ("cli", "rolemrc"),
]
LAYER = {package: level for level, row in enumerate(LAYERS) for package in row}
MODULE_STRING = re.compile(r"rolemrc(\.\w+)+(:\w+)?")


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(("rolemrc", *parts)).removesuffix(".__init__")
        found[name] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The rolemrc modules `name` imports anywhere in its source (a `from X import y` counts as X.y when that is a module)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_STRING.fullmatch(node.value):
            targets = [t for t in [node.value.partition(":")[0]] if t in known]   # not "rolemrc.json", a file name
        out |= {t for t in targets if t == "rolemrc" or t.startswith("rolemrc.")}
    return out


def package(module: str) -> str:
    parts = module.split(".")
    return "rolemrc" if len(parts) == 1 else parts[1]


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) - {name} for name, path in known.items()}


def test_every_package_has_a_layer():
    assert {package(m) for m in modules()} <= set(LAYER), "a new package needs a row in LAYERS"


def test_imports_go_down_the_layers():
    wrong = sorted(f"{a} -> {b}" for a, targets in graph().items() for b in targets
                   if package(a) != package(b) and LAYER[package(b)] >= LAYER[package(a)])
    assert not wrong, "imports sideways or up the layers:\n" + "\n".join(wrong)


def test_no_module_imports_itself_back():
    edges = graph()
    state: dict[str, int] = defaultdict(int)   # 0 unseen, 1 on the current path, 2 done
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges.get(module, ())):
            if state[target] == 1:
                circles.append(" -> ".join([*path[path.index(target):], target]))
            elif state[target] == 0:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(edges):
        if state[module] == 0:
            visit(module, [module])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_architecture_document_shows_this_table():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    for level, row in enumerate(LAYERS):
        assert f"| {level} | {', '.join(row)} |" in doc, f"docs/ARCHITECTURE.md lacks the layer row {level}: {row}"
