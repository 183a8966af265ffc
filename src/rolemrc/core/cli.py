"""Typer apps that report `RolemrcError` the one way: `error: <message>` on stderr, exit `EXIT_INPUT`."""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperGroup

from rolemrc.core.errors import EXIT_INPUT, RolemrcError
from rolemrc.core.extras import extra_of

ROUNDS = 10_000   # every command's default --rounds: bootstrap resamples (and Monte Carlo sign flips)

class ReportingGroup(TyperGroup):
    """A command group whose commands' `RolemrcError`s become one red line and exit code `EXIT_INPUT`."""

    def invoke(self, ctx: Any) -> Any:
        try:
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
