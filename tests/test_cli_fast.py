"""`rolemrc --help` and every command's and group's `--help` import no torch or transformers (heavy imports stay
inside commands, so the help is fast) and no extra's package (so it runs in a core install); every help shows boolean
options as plain flags, and every wrong option value is one `error:` line."""

import json
import os
import subprocess
import sys

WALK = """
import json, sys

from typer.main import get_command
from typer.testing import CliRunner

import rolemrc.cli

root = get_command(rolemrc.cli.app)
runner = CliRunner()
paths, failed, valued_flags = [], [], []


def walk(command, path):
    paths.append(path)
    result = runner.invoke(rolemrc.cli.app, [*path, "--help"])
    if result.exit_code != 0 or "Usage" not in result.output:
        failed.append([path, result.exit_code, result.output[-500:]])
    if "<bool>" in result.output:
        valued_flags.append(path)
    for name, sub in getattr(command, "commands", {}).items():   # a group's commands (typer vendors its click)
        walk(sub, [*path, name])


walk(root, [])
heavy = sorted(m for m in ("torch", "transformers", "trl", "peft", "vllm", "nnsight", "datasets", "faiss", "sklearn",
                          "scipy", "pandas", "numpy", "matplotlib") if m in sys.modules)
from rolemrc.core.extras import EXTRAS
extras = sorted({m for e in EXTRAS.values() for m in e.modules if m in sys.modules})
print(json.dumps({"paths": paths, "failed": failed, "heavy": heavy, "extras": extras, "valued_flags": valued_flags}))
"""


def test_every_help_imports_no_torch():
    out = subprocess.run([sys.executable, "-c", WALK], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert not report["failed"]
    assert len(report["paths"]) > 30   # the root, every group and every command
    assert {"intervene", "select"} <= {p[-1] for p in report["paths"] if p}
    assert "torch" not in report["heavy"] and "transformers" not in report["heavy"], report["heavy"]
    assert report["extras"] == [], "the help imports an extra's package, so it would fail in a core install"
    assert report["valued_flags"] == [], "these helps show a boolean option as taking a <bool> value"


def test_version():
    out = subprocess.run([sys.executable, "-m", "rolemrc.cli", "--version"], capture_output=True, text=True, check=True)
    from rolemrc.core.version import __version__

    assert out.stdout == f"rolemrc {__version__}\n"


def test_old_option_spellings_are_refused_and_the_help_shows_only_the_new(tmp_path):
    """One name per concept: `intervene bake --spec` is `--restraint`; the old spelling is an unknown option, and no
    help lists it."""
    bake = [sys.executable, "-m", "rolemrc.cli", "intervene", "bake", "--model", str(tmp_path), "--out", str(tmp_path / "o")]
    out = subprocess.run([*bake, "--restraint", str(tmp_path / "s.yaml")], capture_output=True, text=True)
    assert out.returncode == 2 and f"error: {tmp_path / 's.yaml'}: no such restraint spec" in out.stderr, out.stderr
    for spelling in ("--spec", "--spec="):
        out = subprocess.run([*bake, spelling + str(tmp_path / "s.yaml")] if spelling.endswith("=") else
                             [*bake, spelling, str(tmp_path / "s.yaml")], capture_output=True, text=True)
        assert out.returncode == 2 and "No such option: --spec" in out.stderr, out.stderr
    helps = {cmd: subprocess.run([sys.executable, "-m", "rolemrc.cli", *cmd, "--help"], capture_output=True, text=True,
                                 env={**os.environ, "COLUMNS": "200"}).stdout
             for cmd in (("intervene", "bake"), ("intervene", "select"), ("train", "sft"), ("bench", "probe"))}
    for cmd, text in helps.items():
        assert not any(f"{old} " in text for old in ("--spec", "--input", "--lr")), (cmd, text)
        assert any(new in text for new in ("--restraint", "--diff", "--learning-rate", "--json")), cmd


def test_the_root_help_names_every_command_of_every_group():
    from typer.main import get_command

    import rolemrc.cli

    root = get_command(rolemrc.cli.app)
    for name, group in root.commands.items():
        for command in getattr(group, "commands", {}):
            assert command in group.help, (name, command, group.help)


def test_each_job_has_one_command():
    """One command per job: no function is mounted under two names (a sub-app of its own and another's)."""
    import inspect

    from typer.main import get_command

    import rolemrc.cli

    names: dict[object, list[str]] = {}

    def walk(command, path):
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])
        if command.callback is not None and not getattr(command, "commands", None):
            names.setdefault(inspect.unwrap(command.callback), []).append(" ".join(path))

    walk(get_command(rolemrc.cli.app), [])
    twice = [n for n in names.values() if len(n) > 1]
    assert len(names) > 30 and not twice, twice


# Spellings of one concept: the first is the name every command uses; the others (its old names) are declared nowhere.
CONCEPTS = [("--restraint", "--spec"), ("--diff", "--input"), ("--learning-rate", "--lr"),
            ("--max-new-tokens", "--max-tokens"), ("--max-steps", "--steps"), ("--base", "--sft", "--reference-model")]


def test_one_name_and_one_default_per_concept():
    """Walks every command's options: no concept spelled two ways, every --device defaults to auto, every --rounds
    to core.cli.ROUNDS, every --dtype is the closed choice of core.placement.DTYPES and (but the benchmarks' random
    models) defaults to auto, every --device-map is a choice of DEVICE_MAPS."""
    from typing import get_args

    from typer.main import get_command

    import rolemrc.cli
    from rolemrc.core.cli import ROUNDS
    from rolemrc.core.placement import DEVICE_MAPS, DTYPES

    def leaves(command, path):
        subs = getattr(command, "commands", None)
        if subs is None:
            yield " ".join(path), command
        for name, sub in (subs or {}).items():
            yield from leaves(sub, [*path, name])

    found = {}
    for path, command in leaves(get_command(rolemrc.cli.app), []):
        for param in command.params:
            for name in getattr(param, "opts", []):
                found.setdefault(name, []).append(path)
            if "--device" in param.opts:
                assert param.default == "auto", path
            if "--rounds" in param.opts:
                assert param.default == ROUNDS, path
            if "--dtype" in param.opts:
                assert get_args(param.type_descriptor.annotation) == DTYPES, path
                assert param.default == "auto" or path.startswith("bench"), path
            if "--device-map" in param.opts:
                assert get_args(param.type_descriptor.annotation) == DEVICE_MAPS, path
    for canonical, *others in CONCEPTS:
        assert canonical in found, canonical
        for other in others:
            assert other not in found, f"{other} (declared by {found[other]}) is spelled {canonical} elsewhere"


def test_the_package_exports_the_methods_verbs_lazily():
    """`import rolemrc` loads no torch; its verbs are the packages' own objects."""
    code = ("import sys, rolemrc; light = 'torch' not in sys.modules; "
            "from rolemrc.intervene import select; from rolemrc.probe import diff; "
            "print(light, rolemrc.select is select, rolemrc.diff is diff, "
            "sorted(n for n in rolemrc.__all__ if n != '__version__' and getattr(rolemrc, n, None) is None))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True", "True", "[]"], out.stdout + out.stderr


def test_boolean_options_are_plain_flags():
    """An option off by default is one plain flag (`--strict`); one on by default (or unset: taken from a config) has
    its `--no-` form too. Neither takes a value."""
    from typer.main import get_command

    import rolemrc.cli

    wrong = []

    def walk(command, path):
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])
        for param in getattr(command, "params", []):
            # the root's own (--version, typer's completion) aside: off by default <=> no --no- form
            if path and getattr(param, "is_flag", False) and (param.default is False) == bool(param.secondary_opts):
                wrong.append((path, param.opts, param.secondary_opts, param.default))

    walk(get_command(rolemrc.cli.app), [])
    assert not wrong, wrong
