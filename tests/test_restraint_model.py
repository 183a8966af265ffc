"""Restraints know their model: a spec selected from a diff records the fingerprint and shape of the diff's B model;
applying it to another model warns once, naming both (a DPO-derived restraint on its SFT model is a legitimate
experiment): through `logging` for a library caller, as one `warning:` line on the command line; `--strict` (or a serve
config's `strict_restraints`) refuses; another shape is refused always."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.errors import EXIT_INPUT
from rolemrc.core.io import write_jsonl
from rolemrc.core.modeling import dir_fingerprint
from rolemrc.intervene import Restraint


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def selected(model_dirs, tokenizer, tmp_path_factory) -> dict[str, Path]:
    """sft (the fixture model), dpo (same shape, other weights), wide (another shape), and a spec selected from
    their diff."""
    from fixtures import test_records

    from rolemrc.core.tiny import build_model

    root = tmp_path_factory.mktemp("restraint-model")
    sft, dpo, wide = model_dirs["llama"], root / "dpo", root / "wide"
    build_model("llama", tokenizer, seed=9, hidden=64, layers=2, intermediate=96).save_pretrained(dpo)
    build_model("llama", tokenizer, seed=3, hidden=64, layers=3, intermediate=96).save_pretrained(wide)
    for folder in (dpo, wide):
        tokenizer.save_pretrained(folder)
    write_jsonl(root / "test.jsonl", test_records(6))
    for args in (("probe", "collect", "--model", sft, "--model", dpo, "--data", root / "test.jsonl",
                  "--out", root / "paired.safetensors"),
                 ("probe", "diff", root / "paired.safetensors", "--out", root / "diff", "--no-figures"),
                 ("intervene", "select", "--diff", root / "diff", "--dimension", "role_style", "--method", "frequency",
                  "--top-k", "4", "--factor", "0", "--out", root / "spec.yaml")):
        result = invoke(*args)
        assert result.exit_code == 0, result.output
    return {"sft": Path(sft), "dpo": dpo, "wide": wide, "spec": root / "spec.yaml", "root": root}


def test_the_spec_records_its_model(selected):
    model = yaml.safe_load(selected["spec"].read_text())["model"]
    assert model["fingerprint"] == dir_fingerprint(selected["dpo"]) and model["fingerprint_of"] == "directory"
    assert model["name"] == str(selected["dpo"]) and (model["layers"], model["width"]) == (2, 96)


@pytest.mark.parametrize("command", ["bake", "lora", "check"])
def test_another_model_warns_and_strict_refuses(selected, command, tmp_path):
    from rolemrc.intervene import fit

    fit.WARNED.clear()
    out = [] if command == "check" else ["--out", tmp_path / "out"]
    same = invoke("intervene", command, "--model", selected["dpo"], "--restraint", selected["spec"], *out)
    assert same.exit_code == 0 and "warning:" not in same.output, same.output
    out = [] if command == "check" else ["--out", tmp_path / "other"]
    other = invoke("intervene", command, "--model", selected["sft"], "--restraint", selected["spec"], *out)
    warnings = [line for line in other.output.splitlines() if line.startswith("warning:")]
    assert other.exit_code == 0 and len(warnings) == 1, other.output
    assert str(selected["dpo"]) in warnings[0] and str(selected["sft"]) in warnings[0]
    assert dir_fingerprint(selected["sft"]) in warnings[0]
    out = [] if command == "check" else ["--out", tmp_path / "strict"]
    strict = invoke("intervene", command, "--model", selected["sft"], "--restraint", selected["spec"], *out, "--strict")
    errors = [line for line in strict.output.splitlines() if line.startswith("error:")]
    assert strict.exit_code == EXIT_INPUT and len(errors) == 1 and str(selected["dpo"]) in errors[0], strict.output
    assert not (tmp_path / "strict").exists()


def test_another_shape_is_refused(selected, tmp_path):
    result = invoke("intervene", "bake", "--model", selected["wide"], "--restraint", selected["spec"],
                    "--out", tmp_path / "out")
    assert result.exit_code == EXIT_INPUT and "with 2 layers of 96 mlp.act units; this model has 3 of 96" in result.output
    assert not (tmp_path / "out").exists()


def test_a_runtime_hook_warns_once_per_pair_of_models(selected, caplog, capsys):
    """A library caller gets one `logging` warning per pair of models, and nothing printed."""
    from rolemrc.core.modeling import load_model
    from rolemrc.intervene import Restraint, applied, fit

    fit.WARNED.clear()
    r = Restraint.load(selected["spec"])
    model, _ = load_model(selected["sft"])
    with caplog.at_level(logging.WARNING, logger="rolemrc"):
        for _ in range(3):
            with applied(model, r):
                pass
    warned = [(rec.name, rec.levelno, rec.getMessage()) for rec in caplog.records]
    assert [w[:2] for w in warned] == [("rolemrc.intervene.fit", logging.WARNING)], warned
    assert warned[0][2].startswith("restraint ") and str(selected["dpo"]) in warned[0][2]
    assert "restraint" not in capsys.readouterr().err   # logged, not printed
    caplog.clear()
    own, _ = load_model(selected["dpo"])
    with applied(own, r):
        pass
    assert not caplog.records


def test_loaded_models_are_told_apart_by_their_weights(selected, tokenizer):
    """A spec selected from loaded models records their weights' fingerprint; an edit in place is another model."""
    import torch
    from fixtures import test_records

    from rolemrc import collect_paired, diff, select
    from rolemrc.core.modeling import load_model
    from rolemrc.intervene.fit import WARNED, check_origin
    from rolemrc.intervene.spec import RestraintError

    WARNED.clear()
    sft, _ = load_model(selected["sft"])
    dpo, _ = load_model(selected["dpo"])
    paired = collect_paired([sft, dpo], test_records(6), tokenizers=[tokenizer, tokenizer])
    r = select(diff(paired), "role_style", method="frequency", factor=0.0, top_k=4)
    assert r.model["fingerprint_of"] == "weights"
    check_origin(r, dpo, strict=True)   # the same model: passes
    with torch.no_grad():
        next(dpo.parameters()).mul_(2.0)   # edited in place: the tensor's version moves, the cache is not trusted
    with pytest.raises(RestraintError, match="selected on"):
        check_origin(r, dpo, strict=True)


def test_serve_strict_restraints_refuses_at_preflight(selected):
    from rolemrc.serve.config import ServeConfig
    from rolemrc.serve.errors import ServeConfigError

    data = {"models": {"sft": {"path": str(selected["sft"])}}, "restraints": {"r": str(selected["spec"])}}
    ServeConfig.from_dict(data).preflight()   # a warning
    with pytest.raises(ServeConfigError, match="strict_restraints"):
        ServeConfig.from_dict({**data, "strict_restraints": True}).preflight()


def test_serve_strict_restraints_refuses_an_inline_one_of_another_model(selected):
    """A client's spec selected on another model: 422 under strict_restraints (served as a request would be)."""
    from rolemrc.serve.catalog import ModelCatalog
    from rolemrc.serve.config import ServeConfig
    from rolemrc.serve.errors import ApiError

    spec = yaml.safe_load(selected["spec"].read_text())
    for path, strict, refused in ((selected["sft"], True, True), (selected["dpo"], True, False),
                                  (selected["sft"], False, False)):
        catalog = ModelCatalog(ServeConfig.from_dict({"models": {"m": str(path)}, "allow_inline_restraints": True,
                                                      "strict_restraints": strict}))
        if refused:
            with pytest.raises(ApiError, match="selected on") as caught:
                catalog.resolve(catalog.engines["m"], None, spec)
            assert caught.value.status == 422
        else:
            assert catalog.resolve(catalog.engines["m"], None, spec).restraint.units == Restraint.from_dict(spec).units


def test_a_spec_from_a_diff_written_before_fingerprint_kinds_warns_once(selected, tmp_path):
    """A diff written before fingerprints said their kind: both kinds are tried, a directory's first, and the check
    before loading and the one after name the same pair (found on SmolLM2 with the calibration's diff)."""
    from rolemrc.intervene import fit

    fit.WARNED.clear()
    data = yaml.safe_load(selected["spec"].read_text())
    data["model"]["fingerprint_of"] = ""
    (tmp_path / "legacy.yaml").write_text(yaml.safe_dump(data))
    result = invoke("intervene", "check", "--model", selected["sft"], "--restraint", tmp_path / "legacy.yaml")
    assert result.exit_code == 0 and result.output.count("warning: restraint") == 1, result.output
