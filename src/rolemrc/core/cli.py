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

# Option names that one name per concept replaced, old -> new. A command that has the new option and not the old one
# still accepts the old spelling (with a note on stderr); the help shows only the new names.
RESPELLED = {
    "--spec": "--restraint",        # the restraint spec (intervene bake, lora, check)
    "--input": "--diff",            # a selector's input (intervene select, sweep run)
    "--lr": "--learning-rate",      # train base, sft, dpo
    "--max-tokens": "--max-new-tokens",   # bench datagen
    "--out": "--json",              # the JSON file of a benchmark
    "--rounds": "--slices",         # bench retrieval: its query slices, not bootstrap rounds
    "--steps": "--max-steps",       # optimiser steps (organism build, bench organism), as in train
}


def respell(command: Any, args: list[str]) -> list[str]:
    """`args` for `command` with the old spellings of its options (RESPELLED) replaced by the new ones."""
    names = {name for param in command.params for name in (*getattr(param, "opts", ()),
                                                           *getattr(param, "secondary_opts", ()))}
    out = []
    for k, arg in enumerate(args):
        if arg == "--":
            return out + args[k:]
        name, eq, value = arg.partition("=")
        new = RESPELLED.get(name)
        if new and new in names and name not in names:
            typer.echo(f"note: {name} is now {new}", err=True)
            arg = new + eq + value
        out.append(arg)
    return out


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
    commands accept the old spellings of renamed options (`RESPELLED`)."""

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        name, command, rest = super().resolve_command(ctx, args)
        if command is not None and not isinstance(command, TyperGroup):
            rest = respell(command, rest)
        return name, command, rest

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
