"""`rolemrc --help` and every command's and group's `--help` import no torch or transformers (heavy imports stay
inside commands, so the help is fast)."""

import json
import subprocess
import sys

WALK = """
import json, sys

from typer.main import get_command
from typer.testing import CliRunner

import rolemrc.cli

root = get_command(rolemrc.cli.app)
runner = CliRunner()
paths, failed = [], []


def walk(command, path):
    paths.append(path)
    result = runner.invoke(rolemrc.cli.app, [*path, "--help"])
    if result.exit_code != 0 or "Usage" not in result.output:
        failed.append([path, result.exit_code, result.output[-500:]])
    for name, sub in getattr(command, "commands", {}).items():   # a group's commands (typer vendors its click)
        walk(sub, [*path, name])


walk(root, [])
heavy = sorted(m for m in ("torch", "transformers", "trl", "peft", "vllm", "nnsight", "datasets", "faiss", "sklearn",
                          "scipy", "pandas", "numpy", "matplotlib") if m in sys.modules)
print(json.dumps({"paths": paths, "failed": failed, "heavy": heavy}))
"""


def test_every_help_imports_no_torch():
    out = subprocess.run([sys.executable, "-c", WALK], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert not report["failed"]
    assert len(report["paths"]) > 30   # the root, every group and every command
    assert {"intervene", "select"} <= {p[-1] for p in report["paths"] if p}
    assert "torch" not in report["heavy"] and "transformers" not in report["heavy"], report["heavy"]


def test_version():
    out = subprocess.run([sys.executable, "-m", "rolemrc.cli", "--version"], capture_output=True, text=True, check=True)
    from rolemrc import __version__

    assert out.stdout == f"rolemrc {__version__}\n"
