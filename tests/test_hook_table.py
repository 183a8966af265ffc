"""The hook point table is the one place a hook point is defined: a row added to HOOK_POINTS (here a
hypothetical `mlp.gate`, the gate projection's output) reaches site(), width(), collection, runtime
restraints and the CLI help; bake and LoRA export read their flags from the row; docs/probe.md shows it."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import rolemrc
from rolemrc.cli import app
from rolemrc.core import hooks
from rolemrc.core.hooks import HOOK_POINTS, HookPoint, UnsupportedModelError, hook_table_markdown, site, width
from rolemrc.core.io import write_jsonl
from rolemrc.core.modeling import load_model
from rolemrc.intervene import Restraint, RestraintError, applied, bake
from rolemrc.intervene.bake import fold_target, lora_exportable
from rolemrc.probe import collect
from rolemrc.probe.backends import make_backend
from rolemrc.probe.errors import ProbeError

GATE = HookPoint("mlp.gate", "gate projection output, before the activation", "gate", False, "intermediate",
                 bridge=None, no_fold="hypothetical row of the hook table test")


@pytest.fixture
def gate_row(monkeypatch):
    """mlp.gate added as one row, plus its module role in the llama-like layout (GPT-2 has no gate)."""
    llama, *others = hooks.LAYOUTS
    gated = dataclasses.replace(llama, modules={**llama.modules, "gate": "mlp.gate_proj"})
    monkeypatch.setattr(hooks, "LAYOUTS", (gated, *others))
    monkeypatch.setitem(HOOK_POINTS, "mlp.gate", GATE)
    return GATE


def test_a_new_row_resolves_sites_and_width(gate_row, model_dirs):
    model, _ = load_model(model_dirs["llama"], device="cpu")
    s = site(model, "mlp.gate", 1)
    assert s.module is model.model.layers[1].mlp.gate_proj and s.module_name == "model.layers.1.mlp.gate_proj"
    assert not s.is_input and width(model, "mlp.gate") == model.config.intermediate_size == 96
    gpt2, _ = load_model(model_dirs["gpt2"], device="cpu")
    with pytest.raises(UnsupportedModelError, match="gpt2 layout has no 'gate' module"):
        site(gpt2, "mlp.gate", 0)


def test_a_new_row_collects_and_restrains(gate_row, model_dirs, records):
    model, tok = load_model(model_dirs["llama"], device="cpu")
    got = collect(model, records[:12], tokenizer=tok, hook="mlp.gate", top_fraction=0.25, progress=False)
    assert got.meta["hook"] == "mlp.gate" and got.meta["width"] == "96" and got.meta["layers"] == "2"
    for d in got.dimensions:  # every observation counts exactly k units per layer
        assert torch.equal(got.count[d].sum(1), torch.full((2,), 24 * got.observations[d]))

    captured = {}
    r = Restraint(name="g", hook="mlp.gate", factor=0.0, units={0: [3, 4]})
    with applied(model, r), torch.no_grad():  # a hook registered after the restraint's sees its result
        handle = model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, a, out: captured.update(t=out))
        model(torch.tensor([[5, 6, 7]]))
    handle.remove()
    assert (captured["t"][..., [3, 4]] == 0).all() and (captured["t"][..., 5] != 0).any()
    with pytest.raises(ProbeError, match=r"mlp\.gate has no TransformerBridge hook"):
        make_backend("transformer-lens", model, "mlp.gate", tok)


def test_the_cli_help_and_collect_see_a_new_row(gate_row, model_dirs, records, tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["probe", "collect", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "mlp.gate" in res.output and "resid.post" in res.output
    data = tmp_path / "test.jsonl"
    write_jsonl(data, records[:6])
    res = runner.invoke(app, ["probe", "collect", "--model", str(model_dirs["llama"]), "--data", str(data),
                              "--hook", "mlp.gate", "--device", "cpu", "--out", str(tmp_path / "g.safetensors")])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output[res.output.index("{"):])["width"] == 96


def test_bake_refuses_a_row_that_does_not_fold(gate_row, model_dirs, tmp_path):
    model, _ = load_model(model_dirs["llama"], device="cpu")
    with pytest.raises(RestraintError, match=r"mlp\.gate cannot be folded into weights exactly: hypothetical row"):
        fold_target(model, "mlp.gate", 0)
    with pytest.raises(RestraintError, match=r"mlp\.gate cannot be folded"):
        bake(model_dirs["llama"], Restraint(name="g", hook="mlp.gate", units={0: [1]}), tmp_path / "out")
    assert not lora_exportable(model, "mlp.gate")


def test_fold_and_lora_flags_are_read_from_the_table(model_dirs, monkeypatch):
    llama, _ = load_model(model_dirs["llama"], device="cpu")
    gpt2, _ = load_model(model_dirs["gpt2"], device="cpu")
    assert fold_target(llama, "attn.out", 1).module is llama.model.layers[1].self_attn.o_proj
    assert fold_target(gpt2, "attn.out", 1).module is gpt2.transformer.h[1].attn.c_proj
    assert [lora_exportable(llama, p) for p in HOOK_POINTS] == [True, True, True, True, False]
    assert [lora_exportable(gpt2, p) for p in HOOK_POINTS] == [True, True, False, False, False]  # c_proj biases
    monkeypatch.setitem(HOOK_POINTS, "mlp.act", dataclasses.replace(HOOK_POINTS["mlp.act"], lora=False))
    assert not lora_exportable(llama, "mlp.act")
    monkeypatch.setitem(HOOK_POINTS, "mlp.out", dataclasses.replace(HOOK_POINTS["mlp.out"], fold=None))
    with pytest.raises(RestraintError, match=r"mlp\.out cannot be folded"):
        fold_target(llama, "mlp.out", 0)


def test_markdown_table_has_a_row_per_point_and_is_the_readme_table(gate_row):
    table = hook_table_markdown()
    assert [line.split("|")[1].strip() for line in table.splitlines()[2:]] == [
        f"`layers.{{i}}.{name}`" for name in HOOK_POINTS]
    assert "output of `mlp.gate_proj`" in table


def test_the_probe_page_shows_the_hook_table():
    page = (Path(rolemrc.__file__).parents[2] / "docs" / "probe.md").read_text(encoding="utf-8")
    assert hook_table_markdown() in page


def test_unknown_points_and_choices_are_input_errors():
    from rolemrc.core.errors import RolemrcError
    from rolemrc.probe import CollectConfig

    for bad, match in (({"hook": "mlp.nope"}, "unknown hook point 'mlp.nope'; choose one of mlp.act"),
                       ({"tokens": "first"}, "unknown token policy 'first'"), ({"rank": "l2"}, "unknown rank"),
                       ({"backend": "jax"}, "unknown backend"), ({"top_fraction": 0}, "top_fraction")):
        with pytest.raises(RolemrcError, match=match):
            CollectConfig(**bad)
