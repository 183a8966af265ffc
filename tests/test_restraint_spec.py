"""The restraint spec is data: making, reading and writing one prints nothing, logs nothing, loads no torch and leaves
no state behind; checking it against a model is `intervene.fit`'s, whose warnings the command line prints as one
`warning:` line each."""

from __future__ import annotations

import ast
import inspect
import logging
import subprocess
import sys
from types import MappingProxyType

import pytest
import typer
from typer.testing import CliRunner

from rolemrc.core.cli import cli_app
from rolemrc.intervene import spec
from rolemrc.intervene.spec import Restraint, RestraintError


def test_making_reading_and_writing_a_spec_prints_and_logs_nothing(tmp_path, capsys, caplog):
    model = {"name": "runs/dpo", "fingerprint": "0123456789abcdef", "fingerprint_of": "directory", "layers": 2,
             "width": 96}
    with caplog.at_level(logging.DEBUG):
        r = Restraint(name="r", hook="mlp.act", units={1: [5, 3], 0: [7]}, model=model)
        for name in ("r.yaml", "r.json"):
            assert Restraint.load(r.save(tmp_path / name)) == r
        assert Restraint.from_dict(r.to_dict()) == r and r.summary()["units"] == 3
        r.check_shape(2, 96)
        with pytest.raises(RestraintError, match="selected on runs/dpo with 2 layers of 96 mlp.act units; this model "
                                                 "has 3 of 96"):
            r.check_shape(3, 96)
    assert capsys.readouterr() == ("", "") and not caplog.records
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.yaml"]   # no file but its own


def test_the_spec_module_holds_no_state():
    """Every name the module binds at its top level is an immutable constant, a class or a function: nothing to
    mutate."""
    tree = ast.parse(inspect.getsource(spec))
    bound = [target.id for node in tree.body if isinstance(node, ast.Assign | ast.AnnAssign)
             for target in (node.targets if isinstance(node, ast.Assign) else [node.target])]
    assert bound[0] == "PAPER_FACTOR" and isinstance(spec.PAPER_FACTOR, float)
    assert all(isinstance(getattr(spec, name), float | tuple | MappingProxyType) for name in bound), bound


def test_the_spec_and_its_fit_import_no_torch():
    code = ("import sys; import rolemrc.intervene.spec, rolemrc.intervene.fit; "
            "print(sorted(m for m in ('torch', 'transformers', 'rolemrc.core.modeling') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_command_prints_rolemrc_warnings_as_warning_lines():
    """A command's logged warnings: one `warning:` line each on stderr; other loggers' and debug records are not
    printed, and the handler is gone once the command returns."""
    app = cli_app(help="t")

    @app.command("warn")
    def warn() -> None:
        logging.getLogger("rolemrc.intervene.fit").warning("restraint 'r' was selected on a")
        logging.getLogger("rolemrc.intervene.fit").debug("a detail")
        logging.getLogger("elsewhere").warning("not ours")
        typer.echo("done")

    @app.command("other")
    def other() -> None:   # a second command: Typer makes the app a group, as `rolemrc` is
        pass

    result = CliRunner().invoke(app, ["warn"])
    assert result.exit_code == 0 and result.stderr == "warning: restraint 'r' was selected on a\n", result.output
    assert result.stdout == "done\n" and not logging.getLogger("rolemrc").handlers
