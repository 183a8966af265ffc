"""The tables of `rolemrc models list`: known models, and converted ones on disk."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from rolemrc.models.known import MODELS
from rolemrc.models.manifest import is_intact, read_manifest, summary


def known_table() -> Table:
    table = Table(title="known models")
    table.add_column("name", no_wrap=True)
    table.add_column("package", no_wrap=True)
    table.add_column("license")
    table.add_column("size")
    table.add_column("description")
    for m in MODELS.values():
        table.add_row(m.name, m.package, m.license, m.size, m.description)
    return table


def disk_table(root: Path) -> Table:
    """One row per directory under `root` that holds a manifest."""
    table = Table(title=f"on disk in {root}")
    for column in ("name", "path", "size"):
        table.add_column(column, no_wrap=True)
    table.add_column("manifest")
    directories = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    for directory in directories:
        manifest = read_manifest(directory)
        if manifest is None:
            continue
        size = sum(manifest.get("files", {}).values()) / 1e6
        state = summary(manifest) if is_intact(directory, manifest) else "[red]incomplete: files missing or changed[/]"
        table.add_row(manifest.get("model") or directory.name, str(directory), f"{size:.0f} MB", state)
    return table


def print_listing(root: Path) -> None:
    console = Console()
    console.print(known_table())
    disk = disk_table(root)
    console.print(disk if disk.row_count else f"nothing converted in {root} yet")
