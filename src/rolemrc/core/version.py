"""The package version: one place, read by the provenance every artifact records (`rolemrc` re-exports it)."""

__version__ = "0.1.0"
