"""Budgets (intervene/budget.py) as `select` applies them: per layer takes exactly K from each chosen layer in the
selector's ranking, share takes round(S x all units of the chosen layers) over them, and the spec states what it
covers; the paper's factor and the frequency selector are named only with a warning line; a calibration's
recommendation supplies method, budget and factor, and one that found nothing is refused with what it found."""

import json
import logging

import pytest
import torch
from test_selectors import DELTA, write_attribution, write_diff
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.errors import RolemrcError
from rolemrc.intervene import Restraint, select
from rolemrc.intervene.budget import Budget, coverage, coverage_text
from rolemrc.intervene.recommendation import RECOMMENDATION, Recommendation, load_recommendation
from rolemrc.intervene.select import paper_factor_note
from rolemrc.intervene.spec import PAPER_FACTOR


def test_per_layer_takes_exactly_k_from_each_layer_in_rank_order(tmp_path):
    diff = write_diff(tmp_path / "d")
    r = select(diff, "multi_turn", method="standardized", factor=0, per_layer=2)
    # |effect| per layer: [0.1, 0.2, 3.0, 0.1] -> 2, 1; [2.5, 0, 0.3, 1.0] -> 0, 3; [0, 4.0, 0.2, 0.05] -> 1, 2
    assert r.units == {0: [1, 2], 1: [0, 3], 2: [1, 2]}
    assert r.source["per_layer"] == 2 and r.source["coverage"]["per_layer"] == {"min": 2, "median": 2.0, "max": 2,
                                                                                 "list": [2, 2, 2]}
    assert select(diff, "multi_turn", method="standardized", factor=0, per_layer=1, layers="1-2").units == {1: [0], 2: [1]}


def test_per_layer_gives_what_a_layer_has_with_a_warning(tmp_path, caplog):
    diff = write_diff(tmp_path / "d")   # effects > 0: 3, 2 and 2 units of layers 0, 1, 2
    with caplog.at_level(logging.WARNING, logger="rolemrc"):
        r = select(diff, "multi_turn", method="standardized", factor=0, per_layer=3, direction="up")
    assert r.units == {0: [0, 1, 2], 1: [2, 3], 2: [1, 3]}
    assert "2 of 3 layers have fewer than 3 units that moved (up)" in caplog.text


def test_share_is_a_global_count_of_the_chosen_layers(tmp_path):
    diff = write_diff(tmp_path / "d")
    top = select(diff, "multi_turn", method="standardized", factor=0, top_k=3)
    assert select(diff, "multi_turn", method="standardized", factor=0, share=0.25).units == top.units   # 0.25 x 12
    assert select(diff, "multi_turn", method="standardized", factor=0, share=0.25, layers="1-2").num_units == 2  # of 8
    half = select(diff, "multi_turn", method="standardized", factor=0, share=0.5, layers="1-2")
    assert half.source["coverage"]["share"] == 4 / 12 and half.source["coverage"]["per_layer"]["list"] == [3, 1]
    with pytest.raises(RolemrcError, match="no unit of 'multi_turn' qualifies.*share 0.01"):
        select(diff, "multi_turn", method="standardized", factor=0, share=0.01)


def test_per_layer_takes_each_layers_best_and_coverage_is_a_tensor_count():
    from rolemrc.intervene.select import Scores, selected_units

    score = torch.tensor([[0.1, 0.9, 0.0, 0.5], [0.8, 0.2, 0.7, 0.0], [0.0, 0.0, 0.3, 0.0]])   # 3 layers x 4 units
    flat, allowed = selected_units(Scores(score, None, "mlp.act", "test"), "standardized", Budget("per_layer", 2),
                                   None, "both")
    assert flat.tolist() == [1, 4, 6, 3, 10] and allowed.all()   # best first: 0.9, 0.8, 0.7, 0.5, then layer 2's one
    c = coverage([256] * 30, 1536, 30)
    assert c["units"] == 7680 and c["share"] == 1 / 6 and "list" not in c["per_layer"]
    assert coverage_text(c) == "7,680 units (16.7% of 46,080): 256 per layer"
    assert coverage_text(coverage([1, 4, 9], 10, 4)) == "14 units (35% of 40): per layer [1, 4, 9]"
    assert [Budget(k, v).label for k, v in (("top_k", 64), ("per_layer", 16), ("share", 1 / 6), ("fdr", 0.05))] == \
        ["top-64", "16/layer", "share 0.167", "q < 0.05"]


def test_the_paper_factor_and_frequency_are_named_with_a_warning_each(tmp_path, caplog):
    diff = write_diff(tmp_path / "d")
    with caplog.at_level(logging.WARNING, logger="rolemrc"):
        select(diff, "multi_turn", method="frequency", factor=PAPER_FACTOR, top_k=2)
    assert "--method frequency reproduces the paper; on the calibration it undid no planted change but" in caplog.text
    assert "factor 0.999999 is the paper's factor: the dtype the model was probed at is not recorded" in caplog.text
    assert "exact no-op there" in paper_factor_note("bfloat16") and "in bfloat16" in paper_factor_note("bfloat16")
    assert "exact no-op there" in paper_factor_note("float16")
    f32 = paper_factor_note("float32")
    assert "changes each selected activation by 1e-06 relative" in f32 and "rolemrc intervene check" in f32
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rolemrc"):
        select(diff, "multi_turn", method="standardized", factor=0, top_k=2)
    assert caplog.text == ""


def write_calibration(path, **recommendation):
    path.mkdir()
    (path / "calibration.json").write_text(json.dumps({"cells": [], RECOMMENDATION: Recommendation(**recommendation).to_dict()}))
    return path


def test_select_takes_method_budget_and_factor_from_a_calibration(tmp_path):
    attribution = write_attribution(tmp_path / "a.safetensors")
    found = write_calibration(tmp_path / "found", status="found", why="attribution x0 undid 95%", selector="attribution",
                              budget={"share": 0.25}, per_layer={"min": 1, "median": 1, "max": 1}, share=0.25, factor=0.0,
                              rests_on={"probe_cases": 48})
    r = select(attribution, "multi_turn", calibration=found)
    assert r.source["method"] == "attribution" and r.source["share"] == 0.25 and r.factor == 0.0
    assert r.units == select(attribution, "multi_turn", method="attribution", share=0.25, factor=0.0).units
    assert r.source["calibration"] == str(found)
    res = CliRunner().invoke(app, ["intervene", "select", "--diff", str(attribution), "--dimension", "multi_turn",
                                   "--calibration", str(found / "calibration.json"), "--out", str(tmp_path / "s.yaml")])
    assert res.exit_code == 0, res.output
    assert Restraint.load(tmp_path / "s.yaml").units == r.units
    none = write_calibration(tmp_path / "none", status="none", why="no selector undoes the planted change")
    res = CliRunner().invoke(app, ["intervene", "select", "--diff", str(attribution), "--dimension", "multi_turn",
                                   "--calibration", str(none), "--out", str(tmp_path / "t.yaml")])
    assert res.exit_code == 2 and res.output.strip().splitlines() == [
        "error: the calibration found no recipe to use (none: no selector undoes the planted change); name --method "
        "and --factor yourself (docs/calibration.md)"]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "calibration.json").write_text("{}")
    with pytest.raises(RolemrcError, match="no 'recommendation' in it"):
        load_recommendation(tmp_path / "old")


def test_the_diff_records_the_dtype_the_spec_states(tmp_path):
    assert DELTA.shape == (3, 4)   # the constructed diff has no fingerprint, so its spec names no model
    assert select(write_diff(tmp_path / "d"), "multi_turn", method="standardized", factor=0, top_k=1).model == {}


def test_sweep_and_calibration_grids_take_one_kind_of_budget(tmp_path):
    """Two kinds of budget are one `error:` line before any model loads or any organism trains."""
    sweep = CliRunner().invoke(app, ["sweep", "run", "--model", str(tmp_path), "--diff", str(tmp_path), "--data",
                                     str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "s"), "--dimension", "role_style",
                                     "--method", "standardized", "--top-k", "4", "--share", "0.1"])
    calibrate = CliRunner().invoke(app, ["organism", "calibrate", "--out", str(tmp_path / "c"), "--per-layer", "16",
                                         "--share", "0.1"])
    for res, given in ((sweep, "--top-k, --share"), (calibrate, "--per-layer, --share")):
        assert res.exit_code == 2 and res.output.strip().splitlines() == [
            f"error: choose at most one of --top-k/--per-layer/--share (given: {given})"], res.output
    assert not (tmp_path / "s").exists() and not (tmp_path / "c").exists()
    from rolemrc.sweep.plan import SweepConfig

    config = SweepConfig(model="m", diff="d", data="t", out=str(tmp_path), dimensions=["role_style"],
                         method="attribution", per_layer=[16, 64])
    assert config.budgets() == [Budget("per_layer", 16), Budget("per_layer", 64)]
    assert [b.value for b in SweepConfig(model="m", diff="d", data="t", out=str(tmp_path), dimensions=["x"],
                                         method="attribution").budgets()] == [0.01, 0.05, 0.17]
