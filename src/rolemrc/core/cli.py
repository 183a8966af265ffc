"""Typer apps that report `RolemrcError` and a wrong option value the one way: `error: <message>` on stderr, exit
`EXIT_INPUT`; print rolemrc's logged warnings as `warning: <message>` lines on stderr while a command runs; show boolean
options as plain flags; and offer a closed set of names as a choice (`choice`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Literal

import typer
from typer._click.exceptions import NoArgsIsHelpError, UsageError
from typer.core import TyperCommand, TyperGroup

from rolemrc.core.errors import EXIT_INPUT, RolemrcError
from rolemrc.core.extras import extra_of
from rolemrc.core.registry import Registry

ROUNDS = 10_000   # every command's default --rounds: bootstrap resamples (and Monte Carlo sign flips)
# every `--limit`: lm-eval's meaning; recorded in the output
LIMIT = typer.Option(None, min=1, help="use only the first N cases of the data (a quick run; recorded in the output, "
                     "and not comparable to a full run)")


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


def choice(names: Registry[Any] | Iterable[str]) -> Any:
    """`names` (a registry's, as they are when the CLI is built) as a `Literal`: an option annotated with it lists them
    in its help and refuses any other value in one `error:` line naming the option."""
    return Literal[names.names() if isinstance(names, Registry) else tuple(names)]


def error_line(message: str) -> typer.Exit:
    """Print `error: <message>` in red on stderr; the exit to raise."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(EXIT_INPUT)


class PlainFlags:
    """A command (or group) whose boolean options show no `<bool>` value in its help: `--strict`, `--x/--no-x`."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params


class Command(PlainFlags, TyperCommand):
    """Every `rolemrc` command's class (`cli_app`'s apps give it to their commands)."""


def live_choices(**registries: Registry[Any]) -> type[Command]:
    """A command class whose options named here (by parameter name) choose from their registry's names as they are
    when the CLI is built: an entry registered after the command's module was imported counts."""

    class LiveChoices(Command):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            for param in self.params:
                if param.name in registries:
                    param.type_descriptor = replace(param.type_descriptor, annotation=choice(registries[param.name]))

    return LiveChoices


class ReportingGroup(PlainFlags, TyperGroup):
    """A command group whose commands' `RolemrcError`s and wrong option values become one red `error:` line and exit
    code `EXIT_INPUT`, and whose commands print rolemrc's logged warnings as `warning:` lines."""

    def invoke(self, ctx: Any) -> Any:
        try:
            with warning_lines():
                return super().invoke(ctx)
        except RolemrcError as exc:
            raise error_line(str(exc)) from None
        except NoArgsIsHelpError:
            raise
        except UsageError as exc:   # a value of the wrong type or outside its choices or range, an unknown option
            raise error_line(exc.format_message().replace("Value error, ", "")) from None
        except ModuleNotFoundError as exc:   # an optional import a command's @needs did not foresee
            extra = extra_of(exc.name or "")
            if extra is None:
                raise
            raise error_line(f"{exc.name!r} is not installed; it comes with rolemrc's {extra!r} extra: "
                        f"pip install 'rolemrc[{extra}]'") from None


class App(typer.Typer):
    """A Typer app whose commands are `Command`s unless they name another class."""

    def command(self, *args: Any, cls: type[TyperCommand] | None = None, **kwargs: Any) -> Any:
        return super().command(*args, cls=cls or Command, **kwargs)


def cli_app(help: str, **kwargs: Any) -> typer.Typer:
    """A sub-app (or the root app) of the `rolemrc` command."""
    kwargs.setdefault("no_args_is_help", True)
    return App(cls=ReportingGroup, help=help, pretty_exceptions_enable=False, **kwargs)
