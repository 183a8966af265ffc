"""Restraints: runtime hooks, exact bakes, no-op detection, selection from a diff, errors."""

import json
import math

import pytest
import torch
from fixtures import write_diff_file
from safetensors import safe_open
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.chat import render_chat
from rolemrc.core.errors import InputError
from rolemrc.core.hooks import site
from rolemrc.core.modeling import load_model
from rolemrc.intervene import Restraint, RestraintError, applied, bake, check, select
from rolemrc.intervene.fit import validate
from rolemrc.intervene.spec import as_restraint

PROMPTS = [[{"role": "user", "content": "the keeper of the lighthouse watched storms"}],
           [{"role": "system", "content": "You are a baker"}, {"role": "user", "content": "sing to the ovens"}]]


def logits(model, tok):
    tok.padding_side = "right"
    batch = tok([render_chat(tok, p) for p in PROMPTS], return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        return model(**batch).logits[batch["attention_mask"].bool()]


def spec(hook, factor=0.5, units=None):
    return Restraint(name="t", hook=hook, factor=factor, units=units or {0: [1, 5, 7], 1: [0, 2, 30]})


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("hook", ["mlp.act", "mlp.post", "mlp.out", "attn.out"])
def test_hook_and_baked_logits_agree(model_dirs, tmp_path, arch, hook):
    model, tok = load_model(model_dirs[arch], device="cpu")
    base = logits(model, tok)
    r = spec(hook)
    with applied(model, r):
        hooked = logits(model, tok)
    assert torch.equal(logits(model, tok), base)  # hooks gone: bit-identical
    assert (hooked - base).abs().max() > 1e-4  # the restraint does something at factor 0.5
    report = bake(model_dirs[arch], r, tmp_path / "baked")
    baked, _ = load_model(tmp_path / "baked", device="cpu")
    torch.testing.assert_close(logits(baked, tok), hooked, rtol=1e-5, atol=1e-5)
    assert report.elements_changed_at_dtype > 0 and not report.numerical_noop


def test_factor_zero_equals_zeroing_and_factor_one_changes_nothing(model_dirs):
    model, tok = load_model(model_dirs["llama"], device="cpu")
    base = logits(model, tok)
    units = {0: [3, 4], 1: [10]}

    def zero(layer):
        def fn(t):
            t = t.clone()
            t[..., units[layer]] = 0
            return t
        return fn

    handles = [site(model, "mlp.act", layer).rewrite(zero(layer)) for layer in units]
    zeroed = logits(model, tok)
    for h in handles:
        h.remove()
    with applied(model, spec("mlp.act", 0.0, units)):
        assert torch.equal(logits(model, tok), zeroed)
    with applied(model, spec("mlp.act", 1.0, units)):
        assert torch.equal(logits(model, tok), base)


def test_restraints_compose_multiplicatively(model_dirs):
    model, tok = load_model(model_dirs["qwen2"], device="cpu")
    units = {0: [1, 2], 1: [5]}
    with applied(model, spec("mlp.act", 0.5, units), spec("mlp.act", 0.5, units)):
        twice = logits(model, tok)
    with applied(model, spec("mlp.act", 0.25, units)):
        once = logits(model, tok)
    torch.testing.assert_close(twice, once, rtol=1e-6, atol=1e-6)


def test_bake_is_deterministic_and_records_provenance(model_dirs, tmp_path):
    r = spec("mlp.act", 1 - 1e-6)
    bake(model_dirs["llama"], r, tmp_path / "a")
    bake(model_dirs["llama"], r, tmp_path / "b")
    tensors, metas = [], []
    for name in ("a", "b"):  # safetensors orders header metadata by hash: compare contents, not bytes
        with safe_open(str(tmp_path / name / "model.safetensors"), "pt") as fh:
            metas.append(fh.metadata())
            tensors.append({k: fh.get_tensor(k) for k in fh.keys()})  # noqa: SIM118 (safe_open is not iterable)
    meta = metas[0]
    assert metas[0] == metas[1] and tensors[0].keys() == tensors[1].keys()
    assert all(torch.equal(tensors[0][k], tensors[1][k]) for k in tensors[0])
    assert json.loads(meta["rolemrc_restraint"])["units"] == {"0": [1, 5, 7], "1": [0, 2, 30]}
    assert len(meta["rolemrc_source_fingerprint"]) == 16
    assert (tmp_path / "a/tokenizer.json").is_file() and (tmp_path / "a/rolemrc.json").is_file()


def test_bf16_paper_factor_is_a_noop_and_float32_is_not(model_dirs, tmp_path):
    r = spec("mlp.act", 1 - 1e-6)
    f32 = bake(model_dirs["llama"], r, tmp_path / "f32", dtype="float32")
    bf16 = bake(model_dirs["llama"], r, tmp_path / "bf16", dtype="bfloat16")
    assert f32.elements_changed_at_dtype > 0 and not f32.numerical_noop
    assert bf16.elements_changed_at_dtype == 0 and bf16.numerical_noop
    report = check(model_dirs["llama"], r, dtype="bfloat16")
    assert report.numerical_noop and report.factor_at_dtype == 1.0 and report.weight_elements_changed == 0
    assert report.verdict.startswith("NUMERICAL NO-OP") and report.hook_vs_original_max_abs == 0
    report = check(model_dirs["llama"], r, baked_dir=tmp_path / "f32", dtype="float32")
    assert not report.numerical_noop and report.weight_elements_changed > 0
    assert report.baked_vs_hook_max_abs < 1e-5


def test_bake_and_check_agree_when_the_dtype_changes(model_dirs, tmp_path):
    """An fp32 model baked to bf16 at 0.999: the factor is 1.0 in bf16 (the runtime hook is an identity there),
    but the bake scales in float32 before rounding, so weights change; check counts the same elements from the
    baked checkpoint and makes no no-op claim. At 1 - 1e-6 nothing changes and both say no-op."""
    units = {0: list(range(0, 96, 2)), 1: list(range(0, 96, 3))}
    r = spec("mlp.act", 0.999, units)
    original, _ = load_model(model_dirs["llama"], device="cpu")
    expected = sum(int(((w * 0.999).bfloat16() != w.bfloat16()).sum())   # independent count: down_proj's input columns
                   for w in (original.model.layers[layer].mlp.down_proj.weight.detach()[:, cols]
                             for layer, cols in units.items()))
    assert expected > 0
    baked = bake(model_dirs["llama"], r, tmp_path / "bf16", dtype="bfloat16")
    assert baked.elements_changed_at_dtype == expected and not baked.numerical_noop
    for baked_dir in (tmp_path / "bf16", None):
        report = check(model_dirs["llama"], r, baked_dir=baked_dir, dtype="bfloat16")
        assert report.weight_elements_changed == expected and report.weights_dtype == "bfloat16"
        assert not report.numerical_noop and "NO-OP" not in report.verdict
        assert report.factor_at_dtype == 1.0 and report.hook_vs_original_max_abs == 0
        assert any("identity at bfloat16" in note for note in report.notes)
    assert report.baked_vs_hook_max_abs is None
    report = check(model_dirs["llama"], r, baked_dir=tmp_path / "bf16", dtype="bfloat16")
    assert report.baked_vs_hook_max_abs == report.baked_vs_original_max_abs > 0  # the hook is an identity: reported
    assert f"differ from hooked by up to {report.baked_vs_hook_max_abs:.3g}" in report.verdict

    r = spec("mlp.act", 1 - 1e-6)
    noop = bake(model_dirs["llama"], r, tmp_path / "noop", dtype="bfloat16")
    report = check(model_dirs["llama"], r, baked_dir=tmp_path / "noop", dtype="bfloat16")
    assert noop.elements_changed_at_dtype == report.weight_elements_changed == 0 and noop.numerical_noop
    assert report.numerical_noop and report.verdict.startswith("NUMERICAL NO-OP")
    assert report.baked_vs_original_max_abs == report.baked_vs_hook_max_abs == 0 and report.notes == []
    # dtype auto: the checkpoint's own (the bf16 bake above says bfloat16 in its config)
    again = bake(tmp_path / "noop", r, tmp_path / "auto", dtype="auto")
    assert again.dtype == "bfloat16"
    assert check(tmp_path / "noop", r, dtype="auto", prompts=["Who keeps the lighthouse?"]).dtype == "bfloat16"


def test_check_refuses_a_checkpoint_not_baked_from_the_model(model_dirs, tmp_path):
    with pytest.raises(RestraintError, match="was it baked from this model"):
        check(model_dirs["llama"], spec("mlp.act"), baked_dir=model_dirs["gpt2"])
    with pytest.raises(InputError, match="an empty folder, not a Hugging Face model directory"):
        check(model_dirs["llama"], spec("mlp.act"), baked_dir=tmp_path)


@pytest.mark.parametrize("data,message", [
    ({"name": "x", "hook": "mlp.gate", "units": {0: [1]}}, "unknown hook point"),
    ({"name": "x", "hook": 5, "units": {0: [1]}}, "hook must be one of"),
    ({"name": "x", "hook": "mlp.act", "units": {0: [1]}, "factor": float("nan")}, "finite"),
    ({"name": "x", "hook": "mlp.act", "units": {0: [1]}, "factor": "big"}, "must be a number"),
    ({"name": "x", "hook": "mlp.act", "units": {0: [1, 1]}}, "duplicate units"),
    ({"name": "x", "hook": "mlp.act", "units": {}}, "non-empty mapping"),
    ({"name": "x", "hook": "mlp.act", "units": {"a": [1]}}, "not an integer"),
    ({"name": "x", "hook": "mlp.act", "units": {0: [1.5]}}, "must be integers"),
    ({"hook": "mlp.act", "units": {0: [1]}}, "missing"),
    ({"name": "x", "hook": "mlp.act", "units": {0: [1]}, "colour": "red"}, "unknown spec field"),
])
def test_invalid_specs(data, message):
    with pytest.raises(RestraintError, match=message):
        Restraint.from_dict(data)


def test_out_of_range_and_unfoldable(model_dirs, tmp_path):
    model, _ = load_model(model_dirs["gpt2"], device="cpu")
    with pytest.raises(RestraintError, match="layer 2 out of range"):
        validate(spec("mlp.act", units={2: [0]}), model)
    with pytest.raises(RestraintError, match="unit 96 in layer 0 out of range"):
        validate(spec("mlp.act", units={0: [96]}), model)
    with pytest.raises(RestraintError, match="unit 64 in layer 0 out of range"):
        validate(spec("attn.out", units={0: [64]}), model)
    with pytest.raises(RestraintError, match="cannot be folded"):
        bake(model_dirs["gpt2"], spec("resid.post"), tmp_path / "x")
    with applied(model, spec("resid.post", 0.0)):  # but it works as a runtime hook
        pass


def test_spec_files_round_trip(tmp_path):
    r = spec("mlp.post", 1 - 1e-6)
    for name in ("s.yaml", "s.json"):
        assert Restraint.load(r.save(tmp_path / name)).to_dict() == r.to_dict()
    assert as_restraint(str(tmp_path / "s.yaml")).units == as_restraint(tmp_path / "s.json").units == r.units
    assert as_restraint(r) is r and as_restraint({"name": "y", "hook": "mlp.act", "units": {3: [1, 2]}}).units == {3: [1, 2]}
    with pytest.raises(RestraintError, match="no such restraint spec"):   # a string names a file, never YAML text
        as_restraint("name: y\nhook: mlp.act\nunits: {3: [1, 2]}\n")
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    with pytest.raises(RestraintError, match="bad.yaml: not valid YAML"):
        Restraint.load(tmp_path / "bad.yaml")


def test_select_from_diff(tmp_path):
    delta = torch.tensor([[0.9, -0.8, 0.1, 0.0], [0.0, 0.5, -0.95, 0.2], [0.3, 0.0, 0.0, -0.4]])
    q = torch.where(delta.abs() > 0.45, 0.001, 0.5)
    write_diff_file(tmp_path / "d", delta, q)
    r = select(tmp_path / "d", "multi_turn", method="frequency", factor=0.0, top_k=3)
    assert r.units == {0: [0, 1], 1: [2]} and r.hook == "mlp.act" and r.name == "multi-turn-restraint"
    assert select(tmp_path / "d", "multi_turn", method="frequency", factor=0.0, top_k=2, direction="up").units == {0: [0], 1: [1]}
    assert select(tmp_path / "d", "multi_turn", method="frequency", factor=0.0, top_k=10, direction="down", layers="1-2").units == {1: [2], 2: [3]}
    assert select(tmp_path / "d/diff.safetensors", "multi_turn", method="frequency", factor=0.0, fdr=0.05).num_units == 4
    assert r.source["top_k"] == 3 and r.source["dimension"] == "multi_turn"
    with pytest.raises(RestraintError, match="not in the diff"):
        select(tmp_path / "d", "nested", method="frequency", factor=0.0, top_k=3)
    with pytest.raises(RestraintError, match="out of range"):
        select(tmp_path / "d", "multi_turn", method="frequency", factor=0.0, top_k=3, layers="2-5")
    with pytest.raises(RestraintError, match="exactly one"):
        select(tmp_path / "d", "multi_turn", method="frequency", factor=0.0)
    with pytest.raises(RestraintError, match="select needs --method and --factor named"):
        select(tmp_path / "d", "multi_turn", top_k=3)


def test_cli_select_bake_check(model_dirs, tmp_path):
    delta = torch.linspace(-1, 1, 2 * 96).reshape(2, 96)
    write_diff_file(tmp_path / "d", delta, torch.full_like(delta, 0.01))
    runner = CliRunner()
    res = runner.invoke(app, ["intervene", "select", "--diff", str(tmp_path / "d"), "--dimension", "multi_turn",
                              "--method", "frequency", "--top-k", "8", "--factor", "0", "--out", str(tmp_path / "s.yaml")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["intervene", "bake", "--model", str(model_dirs["llama"]), "--restraint", str(tmp_path / "s.yaml"),
                              "--out", str(tmp_path / "baked")])
    assert res.exit_code == 0, res.output
    printed = json.loads(res.stdout)   # a summary, not every unit id (those are in the spec and baked/rolemrc.json)
    assert printed["restraint"]["units"] == 8 and sum(printed["restraint"]["per_layer"].values()) == 8
    assert len(res.stdout.splitlines()) < 32
    res = runner.invoke(app, ["intervene", "check", "--model", str(model_dirs["llama"]), "--restraint", str(tmp_path / "s.yaml"),
                              "--baked", str(tmp_path / "baked")])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout[res.stdout.index("{"):res.stdout.rindex("}") + 1])
    assert report["baked_vs_hook_max_abs"] < 1e-5 and report["hook_vs_original_max_abs"] > 0
    res = runner.invoke(app, ["intervene", "bake", "--model", str(model_dirs["llama"]), "--restraint",
                              str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "no such restraint spec" in res.output
    res = runner.invoke(app, ["intervene", "bake", "--model", str(tmp_path / "nomodel"), "--restraint",
                              str(tmp_path / "s.yaml"), "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "nomodel: no such directory" in res.output
    res = runner.invoke(app, ["intervene", "select", "--diff", str(tmp_path / "d"), "--dimension", "nested",
                              "--method", "frequency", "--top-k", "8", "--factor", "0", "--out", str(tmp_path / "t.yaml")])
    assert res.exit_code == 2 and "'nested' is not in the diff" in res.output
    assert math.isclose(Restraint.load(tmp_path / "s.yaml").factor, 0.0)
