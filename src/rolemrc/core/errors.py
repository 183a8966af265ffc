"""One error base for the whole toolkit, and the CLI's one convention for reporting it.

Every error rolemrc raises on bad input or configuration derives from `RolemrcError` (each module keeps
its own subclass, e.g. `RestraintError`, `ProbeMismatchError`); most also derive from `ValueError` or
`RuntimeError`, so `except ValueError` in user code keeps working. The CLI prints such an error as one
`error: ...` line on stderr and exits with `EXIT_INPUT`; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

EXIT_INPUT = 2  # bad input, configuration or environment (the same code click uses for usage errors)


class RolemrcError(Exception):
    """Base of every error rolemrc raises for bad input, configuration or environment."""


class InputError(RolemrcError, ValueError):
    """An input file or argument is missing, unreadable or malformed; the message names it."""
