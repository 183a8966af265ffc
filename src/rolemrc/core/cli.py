"""Typer apps that report `RolemrcError` the one way: `error: <message>` on stderr, exit `EXIT_INPUT`; and rolemrc's
logged warnings as `warning: <message>` lines on stderr while a command runs."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from typer.core import TyperGroup

from rolemrc.core.errors import EXIT_INPUT, RolemrcError
from rolemrc.core.extras import extra_of

ROUNDS = 10_000   # every command's default --rounds: bootstrap resamples (and Monte Carlo sign flips)


class WarningLines(logging.Handler):
    """A logged warning as one `warning: <message>` line on stderr (the stream of the moment, as Typer's tests swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        typer.echo(f"warning: {record.getMessage()}", err=True)


@contextmanager
def warning_lines() -> Iterator[None]:
    """While the block runs, the `rolemrc` loggers' warnings print as `warning:` lines (installed once: a group inside
    a group finds it there). A library caller configures `logging` as it likes."""
    logger = logging.getLogger("rolemrc")
    if any(isinstance(handler, WarningLines) for handler in logger.handlers):
        yield
        return
    handler = WarningLines(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


class ReportingGroup(TyperGroup):
    """A command group whose commands' `RolemrcError`s become one red line and exit code `EXIT_INPUT`, and whose
    commands print rolemrc's logged warnings as `warning:` lines."""

    def invoke(self, ctx: Any) -> Any:
        try:
            with warning_lines():
                return super().invoke(ctx)
        except RolemrcError as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(EXIT_INPUT) from None
        except ModuleNotFoundError as exc:   # an optional import a command's @needs did not foresee
            extra = extra_of(exc.name or "")
            if extra is None:
                raise
            typer.secho(f"error: {exc.name!r} is not installed; it comes with rolemrc's {extra!r} extra: "
                        f"pip install 'rolemrc[{extra}]'", fg=typer.colors.RED, err=True)
            raise typer.Exit(EXIT_INPUT) from None


def cli_app(help: str, **kwargs: Any) -> typer.Typer:
    """A sub-app (or the root app) of the `rolemrc` command."""
    kwargs.setdefault("no_args_is_help", True)
    return typer.Typer(cls=ReportingGroup, help=help, pretty_exceptions_enable=False, **kwargs)
