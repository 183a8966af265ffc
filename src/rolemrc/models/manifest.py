"""`rolemrc-model.json`: what a converted model directory holds and where it came from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MANIFEST = "rolemrc-model.json"


def write_manifest(directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Write the manifest, recording the size of every other file in `directory`; return what was written."""
    files = {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {**manifest, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of `directory`, or None when it has none or it is unreadable."""
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def is_intact(directory: Path, manifest: dict[str, Any]) -> bool:
    """Every file the manifest lists is there with its recorded size."""
    files = manifest.get("files") or {}
    return bool(files) and all((directory / name).is_file() and (directory / name).stat().st_size == size
                               for name, size in files.items())


def summary(manifest: dict[str, Any]) -> str:
    """One line: source, quantisation, tensor count."""
    source = manifest.get("source", {})
    origin = f"{source['package']}=={source['version']}" if "package" in source else Path(source.get("gguf", "?")).name
    return f"{origin}; {manifest.get('conversion', '?')}; {manifest.get('tensor_count', '?')} tensors"
