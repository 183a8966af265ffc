"""The units organism (DPO masked to known MLP units S) and the detection metrics that score a selector's ranking
against S: the metrics by hand and against brute force, the mask on a plain AdamW loop, and a real build on a tiny
Llama (trl's DPO through the mask, the carrier check, paired probes, diffs, attribution, every selector)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file
from test_organism import organism_data

from rolemrc.intervene.inputs import units_of
from rolemrc.organism import KINDS, PLANTED_DIMENSION, OrganismConfig, OrganismError
from rolemrc.organism.calibration_config import CalibrationConfig
from rolemrc.organism.detection import (
    aggregate,
    auroc,
    hits_at,
    labels_of,
    ranking_key,
    t_interval,
    unit_detection,
    verdict,
)
from rolemrc.organism.known import (
    UnitMask,
    changed_outside,
    choose_units,
    random_units,
    revert_units,
    unit_slices,
)
from rolemrc.probe.selectors import SELECTORS


def brute_auroc(key: list[float], labels: list[bool]) -> float:
    """Mann-Whitney U / (n1 n0) over every (positive, negative) pair: 1 if the positive ranks higher, 1/2 if tied."""
    pos = [k for k, y in zip(key, labels) if y]
    neg = [k for k, y in zip(key, labels) if not y]
    return sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg)) / (len(pos) * len(neg))


def test_auroc_of_perfect_reversed_random_and_tied_scores():
    labels = torch.zeros(200, dtype=torch.bool)
    labels[torch.randperm(200, generator=torch.Generator().manual_seed(0))[:20]] = True
    perfect = labels.double()
    assert auroc(perfect, labels) == 1.0 and auroc(-perfect, labels) == 0.0
    assert auroc(torch.zeros(200), labels) == 0.5   # one tie group: every pair counts half
    noise = torch.rand(100_000, generator=torch.Generator().manual_seed(1))
    assert auroc(noise, torch.rand(100_000, generator=torch.Generator().manual_seed(2)) < 0.1) == pytest.approx(0.5, abs=0.01)
    # ties inside and across the classes, against the pair count
    generator = torch.Generator().manual_seed(3)
    for _ in range(20):
        key = torch.randint(0, 4, (17,), generator=generator).double()
        mixed = torch.rand(17, generator=generator) < 0.4
        if 0 < int(mixed.sum()) < 17:
            assert auroc(key, mixed) == pytest.approx(brute_auroc(key.tolist(), mixed.tolist()), abs=1e-12)
    assert auroc(torch.tensor([3.0, 1.0, 1.0, 0.0]), torch.tensor([True, True, False, False])) == (1 + 1 + 0.5 + 1) / 4
    with pytest.raises(OrganismError, match="needs units in S and outside it"):
        auroc(perfect, torch.ones(200, dtype=torch.bool))


def test_precision_and_recall_at_a_cut_by_hand():
    """Scores 9 > 7 = 7 = 7 > 5 > 1 over units a..f, S = {a, c, f}. Top 3: a, then two of the three 7s (one of them
    in S): 1 + 2 x 1/3 expected hits. Top 1: a. Top 4: a and all three 7s: 2 hits. Top 6: all 3."""
    key = torch.tensor([9.0, 7.0, 7.0, 7.0, 5.0, 1.0])
    labels = torch.tensor([True, False, True, False, False, True])
    assert hits_at(key, labels, 3) == pytest.approx(1 + 2 / 3)
    assert (hits_at(key, labels, 1), hits_at(key, labels, 4), hits_at(key, labels, 6), hits_at(key, labels, 60)) == (1, 2, 3, 3)
    # unit_detection: |S| = 3 -> precision at 3 = (5/3)/3; 4|S| = 12 >= 6 units -> recall 1
    score = torch.tensor([[9.0, -7.0, 7.0], [7.0, -5.0, 1.0]])   # the sign does not rank: |score| does
    result = unit_detection(score, None, labels.reshape(2, 3))
    assert result["precision_at_s"] == pytest.approx(5 / 9) and result["recall_at_4s"] == 1.0
    assert result["auroc"] == pytest.approx(brute_auroc([9, 7, 7, 7, 5, 1], labels.tolist()))
    assert result["chance"] == {"auroc": 0.5, "precision_at_s": 0.5, "recall_at_4s": 1.0}


def test_the_ranking_key_is_selects_order_with_ties_only_where_select_cannot_tell():
    """|score| first, then q ascending (a missing q last); equal |score| and q tie, whatever the layer or unit."""
    score = torch.tensor([[0.5, -0.5, 0.5], [0.2, 0.0, -0.5]])
    q = torch.tensor([[0.01, 0.01, 0.2], [0.5, 1.0, torch.nan]])
    key = ranking_key(score, q)
    assert key[0] == key[1] > key[2] > key[5] > key[3] > key[4]
    assert torch.equal(ranking_key(score), ranking_key(-score))
    tied = ranking_key(score)   # without q: the three 0.5s tie
    assert tied[0] == tied[1] == tied[2] == tied[5] > tied[3] > tied[4]


def test_seeds_aggregate_with_a_t_interval_and_a_plain_verdict():
    from scipy.stats import t

    interval = t_interval([0.9, 0.8, 1.0])
    half = t.ppf(0.975, 2) * 0.1 / 3 ** 0.5
    assert interval == pytest.approx({"mean": 0.9, "lo": 0.9 - half, "hi": 0.9 + half, "n": 3})
    assert t_interval([0.7]) == {"mean": 0.7, "lo": None, "hi": None, "n": 1}
    row = lambda a: {"auroc": a, "precision_at_s": a / 2, "recall_at_4s": a, "chance": {"auroc": 0.5}}  # noqa: E731
    seeds = [{"good": row(0.9), "coin": row(0.3)}, {"good": row(0.95), "coin": row(0.7)}, {"good": row(0.92), "coin": row(0.5)}]
    summary = aggregate(seeds)
    assert summary["good"]["verdict"].startswith("beats chance (AUROC 0.92, 95% CI")
    assert summary["coin"]["verdict"].startswith("does not beat chance (AUROC 0.50") and "contains 0.5" in summary["coin"]["verdict"]
    assert summary["good"]["precision_at_s"]["mean"] == pytest.approx((0.9 + 0.95 + 0.92) / 6)
    assert verdict({"mean": 0.1, "lo": 0.05, "hi": 0.2}).startswith("worse than chance")
    assert verdict(t_interval([0.8])).startswith("not tested against chance (one seed")


def test_known_units_are_drawn_with_the_seed_and_must_fit():
    units = choose_units(30, 1536, 3, 32, seed=0)
    assert len(units) == 3 and all(len(u) == 32 == len(set(u)) and max(u) < 1536 for u in units.values())
    assert units == choose_units(30, 1536, 3, 32, seed=0) != choose_units(30, 1536, 3, 32, seed=1)
    assert units_of(json.loads(json.dumps({str(k): v for k, v in units.items()}))) == units
    control = random_units(units, 1536, seed=5)
    assert {k: len(v) for k, v in control.items()} == dict.fromkeys(units, 32)
    with pytest.raises(OrganismError, match="known_layers 3 x known_units 8 do not fit a model of 2 layers"):
        choose_units(2, 96, 3, 8, seed=0)
    labels = labels_of({1: [0, 5]}, (2, 6))
    assert labels.sum() == 2 and labels[1, 5]
    with pytest.raises(OrganismError, match="lie outside the scores' 2 layers x 6 units"):
        labels_of({1: [6]}, (2, 6))


@pytest.mark.parametrize("arch, expected", [
    ("llama", {"model.layers.1.mlp.gate_proj.weight": 0, "model.layers.1.mlp.up_proj.weight": 0,
               "model.layers.1.mlp.down_proj.weight": 1}),
    ("gpt2", {"transformer.h.1.mlp.c_fc.weight": 1, "transformer.h.1.mlp.c_fc.bias": 0,
              "transformer.h.1.mlp.c_proj.weight": 0})])   # c_proj's bias is every unit's: frozen, not a unit's
def test_a_units_parameters_are_its_slices_of_every_mlp_weight_with_its_axis(model_dirs, arch, expected):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs[arch])
    slices = unit_slices(model, {1: [3, 7]})
    assert {name: axis for name, (_, axis, _) in slices.items()} == expected
    for param, axis, mask in slices.values():
        assert int(mask.sum()) == 2 * param.numel() // param.shape[axis]


def test_the_mask_trains_only_s_and_reverting_s_gives_the_sft_model_back(model_dirs):
    """A plain AdamW loop (weight decay 0, as the units organism trains) through UnitMask: every weight outside S's
    slices is exactly the SFT model's, S's slices moved, and S reverted is the SFT model, weight for weight."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    sft = AutoModelForCausalLM.from_pretrained(model_dirs["llama"])
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).train()
    known = {0: [1, 2, 50], 1: [95]}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)   # created before the mask, as trl's
    with pytest.raises(OrganismError, match="weight_decay 0"):
        UnitMask(known).on_train_begin(SimpleNamespace(weight_decay=0.01), None, None, model=model)
    UnitMask(known).on_train_begin(SimpleNamespace(weight_decay=0.0), None, None, model=model)
    ids = torch.randint(5, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    assert changed_outside(model, sft, known) == []
    moved = changed_outside(model, sft, {})
    assert sorted(moved) == sorted(f"model.layers.{layer}.mlp.{p}_proj.weight" for layer in (0, 1)
                                   for p in ("gate", "up", "down"))
    assert changed_outside(revert_units(model, sft, known), sft, {}) == []
    assert changed_outside(revert_units(model, sft, {0: [1, 2, 50]}), sft, {}) == [
        f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]


def test_the_units_kind_is_a_kind_and_its_settings_stay_its_own(tmp_path):
    assert "units" in KINDS and PLANTED_DIMENSION["units"] == "role_style"
    units = OrganismConfig(kind="units", out=str(tmp_path), known_layers=2)
    narration = OrganismConfig(kind="narration", out=str(tmp_path), known_layers=2)
    assert units.pairs_kind == "narration" and units.settings()["known_layers"] == 2
    assert not any(k.startswith("known_") for k in narration.settings())   # other kinds' training keys as before
    with pytest.raises(OrganismError, match="--known-units is 0"):
        OrganismConfig(kind="units", out=str(tmp_path), known_units=0)


KNOWN = {"known_layers": 2, "known_units": 8}   # |S| = 16 of the tiny Llama's 2 x 96 units


@pytest.fixture(scope="module")
def detected(tmp_path_factory, tokenizer):
    """The units organism of a tiny Llama (test_organism.py's fast settings, a larger learning rate so the masked
    update shows, 4 held-out cases, 2 of them for the KL, one random control), then every selector's detection of
    its S from 4 probe cases and 4 attribution pairs, on datagen's data (test_organism.organism_data: made once per
    run, for both files)."""
    from rolemrc.core.tiny import build_model
    from rolemrc.organism import carrier
    from rolemrc.organism.localize import seed_detection

    root = tmp_path_factory.mktemp("known")
    organism_data(tmp_path_factory, root / "organism")
    sft = root / "sft"
    build_model("llama", tokenizer, seed=0, hidden=64, layers=2, intermediate=96, max_positions=2048).save_pretrained(sft)
    tokenizer.save_pretrained(sft)
    settings = {"size": "tiny", "pairs": 8, "steps": 2, "reply_tokens": 8, "eval_tokens": 8, "eval_planted": 4,
                "eval_others": 0, "learning_rate": 3e-2, "max_length": 1600, **KNOWN}
    config = CalibrationConfig(out=str(root / "unused"), attribution_pairs=4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(carrier, "KL_PROMPTS", 2)
        patch.setattr(carrier, "CONTROLS", 1)
        row = seed_detection(root / "organism", 0, config, base=str(sft), settings=settings, probe_n=4)
    return root, sft, row


def test_the_units_organism_differs_from_sft_only_in_s_and_s_carries_all_of_it(detected):
    root, sft, row = detected
    report = json.loads((root / "organism" / "units" / "organism.json").read_text())
    known = units_of(report["known_units"])
    assert report["known_units"] == json.loads((root / "organism" / "units" / "known_units.json").read_text())
    assert sorted(known) == [0, 1] and all(len(u) == 8 for u in known.values())
    assert report["kind"] == "units" and report["planted_dimension"] == "role_style"
    assert json.loads((root / "organism" / "units" / "dpo" / "rolemrc.json").read_text())["config"]["lora"] is False
    # the weights, read back from the saved checkpoints
    dpo, base = load_file(root / "organism" / "units" / "dpo" / "model.safetensors"), load_file(sft / "model.safetensors")
    masks = {name: mask for name, (_, _, mask) in unit_slices(_model(sft), known).items()}
    for name, tensor in base.items():
        same = dpo[name] == tensor
        assert bool((same | masks[name]).all() if name in masks else same.all()), name
    assert any(not bool((dpo[n] == base[n]).all()) for n in masks)
    check = report["carrier"]
    assert check["weights_outside_s_equal_sft"] and check["s_reverted_equals_sft"] and check["dpo_differs_from_sft"]
    kl = check["kl"]
    assert kl["s_reverted"] == {"all": 0.0, "last": 0.0} and kl["dpo"]["all"] > 0 and kl["dpo"]["last"] > 0
    for control in check["controls"]:   # random units of S's layers undo only what they share with S
        assert control["kl"]["all"] > 0.5 * kl["dpo"]["all"]
        if control["overlap_with_s"] == 0:
            assert control["kl"] == kl["dpo"]
    assert row["carrier"] == kl


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def test_every_selector_is_scored_against_s(detected):
    _, _, row = detected
    assert set(row["selectors"]) == set(SELECTORS.names())
    for name, result in row["selectors"].items():
        assert 0 <= result["auroc"] <= 1 and 0 <= result["precision_at_s"] <= 1 and 0 <= result["recall_at_4s"] <= 1
        assert result["units_in_s"] == 16 and result["units"] == 2 * 96, name
    # attribution scores a unit by the DPO margin's gradient times its SFT -> DPO activation change: in the first
    # layer only S's activations changed
    assert row["selectors"]["attribution"]["auroc"] > 0.5
    summary = aggregate([row["selectors"]])
    assert all(s["verdict"].startswith("not tested against chance") for s in summary.values())


def test_known_detection_runs_a_units_organism_per_seed_and_aggregates_them(tmp_path, monkeypatch):
    """The loop over seeds (each organism under out/seed-<s>) and detection.json, with each seed's detection given."""
    from rolemrc.organism import localize

    def fake(root, seed, config, **options):
        assert root == tmp_path / f"seed-{seed}" and options == {"settings": {"steps": 16}, "base": "b", "probe_n": 4}
        metrics = {"auroc": 0.9 + seed / 100, "precision_at_s": 0.5, "recall_at_4s": 1.0,
                   "chance": {"auroc": 0.5, "precision_at_s": 0.1, "recall_at_4s": 0.4}}
        kl = {"dpo": {"last": 2.0}, "s_reverted": {"last": 0.0}, "random_reverted": {"last": 1.9}}
        return {"seed": seed, "selectors": {"attribution": metrics}, "meets_target": seed != 1,
                "organism": f"units organism {'MISSES' if seed == 1 else 'meets'} its target", "carrier": kl,
                "known_units": {"3": [1, 2], "7": [5, 6]}}

    monkeypatch.setattr(localize, "seed_detection", fake)
    config = CalibrationConfig(out=str(tmp_path))
    result = localize.known_detection(tmp_path, [0, 1, 2], config, settings={"steps": 16}, base="b", probe_n=4)
    assert [r["seed"] for r in result["seeds"]] == [0, 1, 2]
    assert result["detection"]["units"]["summary"]["attribution"]["auroc"]["mean"] == pytest.approx(0.91)
    assert result["headline"].startswith("attribution beats chance (AUROC 0.91")
    assert json.loads((tmp_path / "detection.json").read_text())["headline"] == result["headline"]
    text = (tmp_path / "detection.md").read_text()
    assert "missed its behavioural target in 1 of 3 seed(s)" in text and "- seed 1: units organism MISSES" in text
    assert "| 1 | units organism MISSES its target | 4 | 2 | 0 | 1.9 |" in text
    assert (tmp_path / "detection.html").is_file()
    # refused before any organism trains
    for bad, match in (({"hook": "resid.post"}, "--hook resid.post"), ({"seeds": [0, 0]}, "--seeds")):
        with pytest.raises(OrganismError, match=match):
            localize.known_detection(tmp_path, bad.get("seeds", [0]), CalibrationConfig(out=str(tmp_path),
                                                                                         hook=bad.get("hook", "mlp.act")))
