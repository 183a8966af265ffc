"""Building blocks of the restraint sweep: random-unit controls, per-row restraints in one batch, and generation
that mixes restraints in its batches."""

import pytest
import torch
from fixtures import save_peaked_llama

from rolemrc.core.chat import render_chat
from rolemrc.core.modeling import load_model
from rolemrc.core.records import normalize_record
from rolemrc.eval.generate import GenerateConfig, generate, generate_rows
from rolemrc.generate.scales import SlotScales
from rolemrc.intervene import Restraint, RestraintError, applied
from rolemrc.intervene.bake import changed_elements, elements_changed, fold_restraint
from rolemrc.sweep.controls import draw_controls

SELECTED = Restraint(name="kb", hook="mlp.act", factor=0.0, units={0: [1, 5, 7], 3: list(range(40))})
PROMPT = [{"role": "user", "content": "the keeper of the lighthouse watched storms"}]


def test_controls_are_reproducible_same_sized_and_disjoint():
    controls = draw_controls(SELECTED, width=96, n=3, seed=7)
    assert [c.to_dict() for c in controls] == [c.to_dict() for c in draw_controls(SELECTED, width=96, n=3, seed=7)]
    assert controls[0].units != controls[1].units != controls[2].units
    assert draw_controls(SELECTED, width=96, n=1, seed=8)[0].units != controls[0].units
    for c in controls:
        assert c.factor == SELECTED.factor and c.hook == SELECTED.hook
        assert {layer: len(u) for layer, u in c.units.items()} == {0: 3, 3: 40}
        assert all(not set(c.units[layer]) & set(SELECTED.units[layer]) for layer in SELECTED.units)
        assert max(max(u) for u in c.units.values()) < 96


def test_controls_refuse_a_layer_with_too_few_units_left():
    with pytest.raises(RestraintError, match="too few remain"):
        draw_controls(SELECTED, width=70, n=1)


@pytest.mark.parametrize("hook", ["mlp.act", "attn.out"])
def test_per_row_restraints_equal_each_restraint_alone(model_dirs, hook):
    """One batch whose rows (the engine's slots) carry different restraints of every hooked kind (or none) gives each
    row the logits it gets alone; releasing the slots removes the hooks."""
    model, tok = load_model(model_dirs["llama"], device="cpu")
    n = model.config.intermediate_size if hook == "mlp.act" else model.config.hidden_size
    a = Restraint(name="a", hook=hook, factor=0.0, units={0: [1, 5, 7], 1: [2, 3]})
    b = Restraint(name="b", hook=hook, factor=0.5, units={1: [2, 9]})
    p = Restraint(name="p", hook=hook, kind="patch", units={1: [9, 4]}, values={1: [0.75, -2.0]})
    d = Restraint(name="d", hook=hook, kind="direction",
                  directions={0: torch.randn(n, generator=torch.Generator().manual_seed(0)).tolist()})
    rows = [a, None, b, a, p, d]
    ids = tok([render_chat(tok, PROMPT)] * len(rows), return_tensors="pt", add_special_tokens=False)["input_ids"]
    scales = SlotScales(model, slots=8)
    for slot, r in enumerate(rows):
        scales.assign(slot, r)
    scales.rows = slice(0, len(rows))
    with torch.no_grad():
        together = model(ids).logits
    assert scales.sites == ((hook, 0, ("scale", "direction")), (hook, 1, ("scale", "shift")))
    for slot in range(len(rows)):
        scales.release(slot)
    assert scales.sites == () and not scales.users
    with torch.no_grad():
        plain = model(ids[:1]).logits[0]
        alone = {}
        for r in (a, b, p, d):
            with applied(model, r):
                alone[r.name] = model(ids[:1]).logits[0]
        after = model(ids[:1]).logits[0]
    for i, r in enumerate(rows):
        torch.testing.assert_close(together[i], plain if r is None else alone[r.name], rtol=0, atol=1e-5)
    assert not any(torch.allclose(alone[r.name], plain) for r in (a, b, p, d))
    torch.testing.assert_close(after, plain, rtol=0, atol=0)   # the hooks are gone


@pytest.fixture(scope="module")
def peaked(tmp_path_factory, tokenizer):
    """A small Llama with a scaled-up output head, so greedy choices have clear margins across batchings."""
    return save_peaked_llama(tmp_path_factory.mktemp("peaked"), tokenizer)


def test_generate_rows_mixes_restraints_in_batches_like_separate_runs(peaked, records):
    items = records[:6]
    a = Restraint(name="a", hook="mlp.act", factor=0.0, units={0: list(range(48)), 1: list(range(48))})
    config = GenerateConfig(model=str(peaked), max_new_tokens=8, batch_size=4, progress=False)
    separate = {name: [r["response"] for r in generate(items, model=str(peaked), max_new_tokens=8, batch_size=4,
                                                        restraint=spec, progress=False)]
                for name, spec in (("a", a), ("none", None))}
    assert separate["a"] != separate["none"]
    model, tok = load_model(peaked, device="cpu")
    rows = [*items, *items]
    mixed = generate_rows(model, tok, [normalize_record(r, k, "test")[0] for k, r in enumerate(rows)],
                          [a] * len(items) + [None] * len(items), config)
    assert [r["response"] for r in mixed] == separate["a"] + separate["none"]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factor", [1 - 1e-6, 0.5])
def test_elements_changed_counts_what_a_bake_changes_without_editing(model_dirs, arch, dtype, factor):
    model, _ = load_model(model_dirs[arch], device="cpu")
    r = Restraint(name="r", hook="mlp.act", factor=factor, units={0: [1, 5, 7], 1: [0, 2, 30]})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    counted = elements_changed(model, r, dtype)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    fold_restraint(model, r)
    assert counted == changed_elements(before, {n: p.detach() for n, p in model.named_parameters()}, dtype)
    assert (counted == 0) == (dtype == torch.bfloat16 and factor == 1 - 1e-6)
