"""One error convention: every rolemrc error derives from RolemrcError, every CLI reports it as one
`error:` line with exit code 2, and bad data files are refused, naming the file, before any model loads."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import rolemrc
from rolemrc.cli import SUBAPPS, app
from rolemrc.core.cli import ReportingGroup
from rolemrc.core.errors import EXIT_INPUT, RolemrcError

ROOT = Path(rolemrc.__file__).parent
# HTTP-level, never seen by a CLI: an HTTP status for the server's error body, and the body-size
# middleware's internal signal (turned into a 413 before anything leaves the server)
HTTP_ONLY = {"rolemrc.serve.errors.ApiError", "rolemrc.serve.middleware.TooLarge", "rolemrc.serve.outcome.Ended"}


def all_modules() -> list:
    names = [m.name for m in pkgutil.walk_packages([str(ROOT)], "rolemrc.")]
    return [importlib.import_module(name) for name in names if not name.endswith("__main__")]


def test_every_error_class_derives_from_rolemrc_error():
    strays = []
    for module in all_modules():
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__
                    and not issubclass(obj, RolemrcError) and f"{module.__name__}.{name}" not in HTTP_ONLY):
                strays.append(f"{module.__name__}.{name}")
    assert strays == []


def test_every_cli_reports_errors_one_way():
    groups = {name: importlib.import_module(module).app.info.cls for name, (module, _) in SUBAPPS.items()}
    assert app.info.cls is ReportingGroup and all(cls is ReportingGroup for cls in groups.values()), groups


def test_no_cli_swallows_builtin_errors():
    """CLIs raise RolemrcError subclasses at the source; none catches ValueError/KeyError wholesale."""
    caught = []
    for path in [*ROOT.glob("*/cli.py"), *ROOT.glob("*/*_cli.py"), ROOT / "cli.py", *ROOT.glob("demo/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                names = {n.id for n in ast.walk(node.type) if isinstance(n, ast.Name)}
                if names & {"ValueError", "KeyError", "Exception", "FileNotFoundError", "RuntimeError"}:
                    caught.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert caught == []


@pytest.fixture
def no_model_loads(monkeypatch):
    """Loading any model fails the test: data must be checked first."""
    import transformers

    def refuse(*_a, **_k):
        raise AssertionError("a model was loaded before the data file was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)


@pytest.mark.parametrize("content", [b"\xff\xfe\x00binary\n", b'{"id": "a", "question": [}\n'], ids=["binary", "bad-json"])
def test_bad_data_is_refused_before_the_model_loads(model_dirs, tmp_path, content, no_model_loads):
    data = tmp_path / "data.jsonl"
    data.write_bytes(content)
    model = str(model_dirs["llama"])
    commands = {
        "eval run": ["eval", "run", "--model", model, "--data", str(data), "--out", str(tmp_path / "e")],
        "probe collect": ["probe", "collect", "--model", model, "--data", str(data), "--out", str(tmp_path / "p.st")],
        "probe attribute": ["probe", "attribute", "--model", model, "--model", model, "--pairs", str(data),
                            "--out", str(tmp_path / "a.st")],
        "train sft": ["train", "sft", "--model", model, "--data", str(data), "--out", str(tmp_path / "s")],
        "train dpo": ["train", "dpo", "--model", model, "--data", str(data), "--out", str(tmp_path / "d")],
    }
    for name, args in commands.items():
        result = CliRunner().invoke(app, args)
        assert result.exit_code == EXIT_INPUT, (name, result.output, result.exception)
        said = f"{data} is a binary file" if b"\x00" in content else f"{data}:1"   # its kind, or the bad line
        assert said in result.output and result.output.count("error:") == 1, (name, result.output)
