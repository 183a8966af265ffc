"""mkdocs hooks: the site's home page is README.md (its one home), with its `docs/` links made relative to docs/; and
the API pages' source tree. The package is the repository root (pyproject's package-dir), a folder not named
`rolemrc` that also holds virtual environments, so mkdocstrings reads a tree of links to the package's own folders
and modules, built here in scripts/api/rolemrc (ignored by git)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def on_startup(command: str, dirty: bool) -> None:
    """Before any plugin reads its configuration (mkdocstrings resolves its `paths` then)."""
    root = ROOT
    tree = root / "scripts" / "api" / "rolemrc"
    shutil.rmtree(tree.parent, ignore_errors=True)
    tree.mkdir(parents=True)
    for entry in sorted(root.iterdir()):
        if (entry.is_dir() and (entry / "__init__.py").is_file()) or entry.suffix == ".py":
            (tree / entry.name).symlink_to(entry)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    readme = Path(config["config_file_path"]).parent / "README.md"
    return readme.read_text(encoding="utf-8").replace("](docs/", "](")
