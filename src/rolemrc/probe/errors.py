"""The probe's errors: bad input or configuration, and missing probe/diff files."""

from __future__ import annotations

from collections.abc import Iterable

from rolemrc.core.errors import RolemrcError


class ProbeError(RolemrcError, ValueError):
    """Bad probe input or configuration; the message says what and where."""


class ProbeFileError(RolemrcError, FileNotFoundError):
    """A probe or diff file does not exist; the message names it."""


def check_choice(what: str, value: object, choices: Iterable[str]) -> None:
    """ProbeError ("unknown <what> ...; choose one of ...") unless `value` is one of `choices`."""
    choices = tuple(choices)
    if value not in choices:
        raise ProbeError(f"unknown {what} {value!r}; choose one of {', '.join(choices)}")
