"""Documented commands are tests: every `rolemrc ...` command in a shell block of README.md and docs/*.md (also the
`-m rolemrc.cli` of a launcher such as torchrun) parses with the real CLI, down to its subcommand: every option
exists, takes as many values as it is given, and every value has its type and is one of its choices. Nothing runs:
parsing makes a context and invokes no command."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import NamedTuple

import pytest
import typer
from typer._click import Command  # typer vendors its click
from typer._click.exceptions import UsageError
from typer.core import TyperGroup
from typer.main import get_command

from rolemrc.cli import app

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"", "bash", "sh", "shell", "console"}   # fence languages read as shell; "" is a bare fence
PROMPT = "$ "   # a console block's commands start with it; its other lines are output
FENCE = re.compile(r"^\s*```\s*(\S*)")
MENTIONS = re.compile(r"\brolemrc(?:\.cli)?\s")   # a line worth splitting into words
ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
SEPARATORS = {"&&", "||", ";", "|", "|&", "&", "(", ")"}


class Documented(NamedTuple):
    """A documented command: where it is, as written (continuations joined), and its arguments after `rolemrc`
    (None: the line does not split into shell words)."""

    where: str
    text: str
    args: list[str] | None


def shell_lines(page: Path) -> list[tuple[int, str]]:
    """The logical lines of the page's shell blocks (`\\` continuations joined; in a console block, the prompted
    ones), each with its first line's number."""
    lines: list[tuple[int, str]] = []
    language: str | None = None   # the open block's fence language; None outside blocks
    pending: list[str] = []
    start = 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            language = fence.group(1) if language is None else None
            continue
        if language not in SHELL or (language == "console" and not pending and not line.startswith(PROMPT)):
            continue
        if not pending:
            start = number
        text = line.rstrip()
        pending.append(text.removesuffix("\\"))
        if not text.endswith("\\"):
            lines.append((start, " ".join(pending).removeprefix(PROMPT)))
            pending = []
    return lines


def words(line: str) -> list[str]:
    """The line's shell words: comments dropped, quotes removed, `&&`, `|`, `;` and `&` kept as words of their own."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def simple_commands(tokens: list[str]) -> list[list[str]]:
    """The simple commands of a line's words: split at separators, without redirections (`> f`, `2>&1`) and leading
    variable assignments (`FOO=1 cmd`)."""
    commands: list[list[str]] = [[]]
    skip_next = False
    for token in tokens:
        if skip_next:
            skip_next = False
        elif token in SEPARATORS:
            commands.append([])
        elif token[0] in "<>" or token in ("&>", ">&"):
            skip_next = True
            if commands[-1] and commands[-1][-1].isdigit():   # the 2 of 2>&1
                commands[-1].pop()
        elif commands[-1] or not ASSIGNMENT.match(token):
            commands[-1].append(token)
    return [c for c in commands if c]


def rolemrc_args(command: list[str]) -> list[str] | None:
    """The arguments a simple command gives `rolemrc` (`rolemrc ARGS`, or a launcher's `-m rolemrc.cli ARGS`), or
    None when it runs something else."""
    if command[0] == "rolemrc":
        return command[1:]
    for i, word in enumerate(command[1:], 1):
        if word == "rolemrc.cli" and command[i - 1] == "-m":
            return command[i + 1:]
    return None


def documented() -> list[Documented]:
    """Every rolemrc command in the pages' shell blocks."""
    found = []
    for page in PAGES:
        for number, line in shell_lines(page):
            if not MENTIONS.search(line):
                continue
            where = f"{page.relative_to(ROOT)}:{number}"
            try:
                commands = simple_commands(words(line))
            except ValueError:   # an unclosed quote
                found.append(Documented(where, line, None))
                continue
            found += [Documented(where, " ".join(c), args) for c in commands if (args := rolemrc_args(c)) is not None]
    return found


COMMANDS = documented()


@pytest.fixture(scope="module")
def root() -> Command:
    """The `rolemrc` command as click sees it, built once."""
    return get_command(app)


def parse(root: Command, args: list[str]) -> None:
    """Parse `args` as `rolemrc ARGS` would, group by group down to the command, invoking nothing: an unknown option
    or command, a missing or extra value, or a value of the wrong type or outside its choices raises UsageError."""
    command, name, parent = root, "rolemrc", None
    while True:
        context = command.make_context(name, list(args), parent=parent)
        if not isinstance(command, TyperGroup):
            return
        name, command, args = command.resolve_command(context, [*context._protected_args, *context.args])
        parent = context


def test_the_pages_document_many_commands():
    pages = {c.where.split(":")[0] for c in COMMANDS}
    assert len(COMMANDS) >= 90, [c.text for c in COMMANDS]
    assert {"README.md", "docs/calibration.md", "docs/intervene.md", "docs/probe.md", "docs/gpu.md"} <= pages


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.where} {c.text}" for c in COMMANDS])
def test_a_documented_command_parses(root, command: Documented):
    assert command.args is not None, f"{command.where}: not shell words (an unclosed quote): {command.text}"
    try:
        parse(root, command.args)
    except typer.Exit as done:   # --help or --version: parsed, then exited
        assert done.exit_code == 0, f"{command.where}: {command.text}"
    except UsageError as error:
        why = error.format_message() or "a group without its command"
        pytest.fail(f"{command.where}: {command.text}\n{why}", pytrace=False)
