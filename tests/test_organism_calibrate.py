"""`organism calibrate`: calibration end to end on organisms whose answer is known by construction.

planted: the DPO model is fixtures.save_planted_llama (ANSWERABLE_UNITS of layer 1 fire on every token and make it
refuse), its SFT model the same Llama with those units switched off (it answers), so the change lives in exactly those
4 units and the rules judge's multi_turn aspect sees it (both carry the same small noise, so units do not tie). null:
the SFT model against itself with other noise: every unit moves a little, no behaviour changes. Real probes,
diffs, attribution, sweeps with random-unit controls and the rules judge; only the sweep's own figures are skipped."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures import ANSWERABLE_UNITS, answerable_records, save_planted_llama

from rolemrc.core.io import write_jsonl
from rolemrc.eval import generate, score
from rolemrc.intervene import select
from rolemrc.intervene.budget import Budget
from rolemrc.intervene.recommendation import RECOMMENDATION
from rolemrc.intervene.spec import PAPER_FACTOR
from rolemrc.organism.calibration import calibrate, load_calibration, probe_cases
from rolemrc.organism.calibration_config import CalibrationConfig, Organism, sweeps
from rolemrc.organism.calibration_report import headline
from rolemrc.organism.config import OrganismError
from rolemrc.organism.recommend import recommend
from rolemrc.organism.scoring import KL_FLOOR, broken, finds_change, flag_restorations, kl_verdicts, restoration, toward_sft
from rolemrc.sweep import plots as sweep_plots

DIMENSION = "multi_turn"
NOISE = 1e-3   # every MLP weight: no exact ties between units, no greedy token changed
KL_CONTROLS = 5   # random-unit controls per KL cell (the default 10 doubles the fixture's time, mostly footprints)


def organism(root: Path, kind: str, sft: Path, dpo: Path, heldout: Path, probe: Path, dimension: str | None) -> Organism:
    """The organism's pairs (DPO's refusal chosen over SFT's answer) and the SFT model's eval of the held-out cases."""
    pairs = root / f"{kind}-pairs.jsonl"
    write_jsonl(pairs, [{"id": r["id"], "prompt": r["question"], "chosen": "cannot answer cannot answer",
                         "rejected": "keeper keeper keeper", "task": r["task"]} for r in answerable_records(6, "a")])
    sft_eval = root / f"{kind}-sft-eval"
    score(generate(str(heldout), model=str(sft), max_new_tokens=6, progress=False), judge="rules", metrics=[],
          progress=False).save(sft_eval, chart=False)
    return Organism(kind, str(sft), str(dpo), str(pairs), str(heldout), str(sft_eval), str(probe), dimension)


def build_organisms(root: Path, tokenizer, heldout: int = 12) -> list[Organism]:
    """The planted organism and the null one, their models and `heldout` held-out cases under `root`."""
    sft = save_planted_llama(root / "sft", tokenizer, units_on=False, noise=NOISE)
    dpo = save_planted_llama(root / "dpo", tokenizer, noise=NOISE)
    # the null's DPO model: the SFT model with other noise, so every unit moves a little and nothing behaves otherwise
    null = save_planted_llama(root / "null-dpo", tokenizer, units_on=False, noise=NOISE, noise_seed=1)
    write_jsonl(root / "heldout.jsonl", answerable_records(heldout, "h"))
    write_jsonl(root / "probe.jsonl", answerable_records(10, "q"))
    organisms = [organism(root, "planted", sft, dpo, root / "heldout.jsonl", root / "probe.jsonl", DIMENSION),
                 organism(root, "null", sft, null, root / "heldout.jsonl", root / "probe.jsonl", None)]
    organisms[0].known_units = {"1": ANSWERABLE_UNITS}   # where the planted change lives: a unit-level answer
    return organisms


def run_calibration(root: Path, tokenizer, heldout: int = 12, **settings) -> dict:
    config = CalibrationConfig(out=str(root / "out"), top_k=[4, 16], paper_factor=False, attribution_pairs=6,
                               max_new_tokens=6, **settings)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sweep_plots, "write_sweep_figures", lambda summary, out: {})   # PNGs: ~10 s, tested elsewhere
        return calibrate(build_organisms(root, tokenizer, heldout), config)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, tokenizer):
    """Cells scored by the rules judge on generated replies, one control each."""
    root = tmp_path_factory.mktemp("calibration")
    return run_calibration(root, tokenizer, measure="judge", factors=[0.0, PAPER_FACTOR], controls=1), root


@pytest.fixture(scope="module")
def calibrated_kl(tmp_path_factory, tokenizer):
    """The same organisms, each cell scored by its KL to the SFT model on the SFT model's replies (forward passes), on
    twice the held-out cases: each half (selection, confirmation) has 12."""
    root = tmp_path_factory.mktemp("calibration-kl")
    return run_calibration(root, tokenizer, heldout=24, measure="kl", factors=[0.0], controls=KL_CONTROLS,
                           frontier=True), root


def cells(result, organism_kind=None, selector=None, factor=None, top_k=None):
    return [r for r in result["cells"] if organism_kind in (None, r["organism"])
            and selector in (None, r["selector"]) and factor in (None, r["factor"])
            and top_k in (None, r["budget"].get("top_k"))]


def test_selectors_that_see_the_change_undo_it_and_random_units_do_not(calibrated):
    """standardized and attribution score exactly the 4 planted units (no other unit's activation changed): a budget
    of 4 units undoes the whole change; the frequency selectors also rank units the planted ones pushed
    out of the top 20%, so they need the larger budget. Random units of the same layers undo nothing."""
    result, _ = calibrated
    for selector in ("standardized", "attribution"):
        (row,) = cells(result, "planted", selector, 0.0, 4)
        assert row["units"] == 4 and row["restoration"]["share"] == 1 and row["restoration"]["lo"] == 1, (selector, row)
        assert row["controls_restoration"] == [0.0], (selector, row)
        assert row["p_vs_baseline"] < 0.05 and row["p_vs_controls"] < 0.05 and finds_change(row), (selector, row)
        spec = json.loads((Path(result["sweeps"][f"planted/{selector}"]) / "plan.json").read_text())["cells"][1]
        assert spec["restraint"]["units"] == {"1": ANSWERABLE_UNITS}, selector
    for selector in ("frequency", "frequency-all"):
        (small,) = cells(result, "planted", selector, 0.0, 4)
        (large,) = cells(result, "planted", selector, 0.0, 16)
        assert not finds_change(small) and small["restoration"]["share"] < 1, (selector, small)
        assert finds_change(large) and large["restoration"]["share"] == 1, (selector, large)
    assert result["headline"].startswith("The planted change (multi_turn) is found by standardized from 4 units "
                                         "(6.25% of 64): per layer [0, 4] (x0: 100% undone")
    assert result["diff_flags"]["planted"][DIMENSION]["all"]["effect"] == len(ANSWERABLE_UNITS)


def test_the_recommendation_is_the_best_cell_and_select_takes_it(calibrated):
    """standardized and attribution both undo all of it from the 4 planted units, the null organism is left alone:
    found, the first of them; `select --calibration` then picks the planted units from the diff it ranks."""
    result, root = calibrated
    rec = result["recommendation"]
    assert rec["status"] == "found" and rec["selector"] == "standardized" and rec["budget"] == {"top_k": 4}
    assert rec["factor"] == 0.0 and rec["share"] == 4 / 64 and rec["per_layer"]["max"] == 4
    assert rec["why"].startswith("standardized x0 at 4 units") and "planted 100% undone (95% CI 100% to 100%)" in rec["why"]
    assert rec["holds_over"] == [rec["rests_on"]] and rec["fails_over"] == []
    assert rec["rests_on"]["probe_cases"] == 10 and rec["rests_on"]["heldout_cases"] == 12
    assert rec["rests_on"]["attribution_pairs"] == 6
    spec = select(root / "out" / "planted" / "diff-all", DIMENSION, calibration=root / "out")
    assert spec.units == {1: ANSWERABLE_UNITS} and spec.factor == 0.0 and spec.source["method"] == "standardized"
    assert "Recommended: standardized" in (root / "out" / "calibration.md").read_text()


def test_the_paper_factor_changes_nothing_here(calibrated):
    result, _ = calibrated
    paper = cells(result, "planted", factor=PAPER_FACTOR)
    assert paper and all(r["restoration"]["share"] == 0 and not r["flagged"] for r in paper)
    assert f"changed the selected dimension's pass rate in 0 of {len(cells(result, None, factor=PAPER_FACTOR))}" \
        in result["headline"]


def test_the_null_organism_flags_nothing(calibrated):
    result, _ = calibrated
    null = cells(result, "null")
    assert len(null) == 4 * 2 * 2
    assert not any(r["flagged"] or r["changed"] for r in null) and result["null_false_positive_rate"] == 0
    assert all(math.isnan(r["restoration"]["share"]) for r in null)   # no change to undo
    # its units did change (other noise): the diff may flag them; the sweep shows that none of them matters
    assert all(v is None or v >= 0 for flags in result["diff_flags"]["null"][DIMENSION].values() for v in flags.values())
    assert "Null organism: 0 of 16 cells flagged (0%" in result["headline"]


def test_an_organisms_sweeps_share_one_store_of_cells(calibrated):
    """Each cell is generated once per organism: the four sweeps' common baseline, and the cells of selectors that
    chose the same units (on the planted organism standardized and attribution both choose the planted units)."""
    result, root = calibrated
    for kind in ("planted", "null"):
        plans = [json.loads((Path(d) / "plan.json").read_text())["cells"] for k, d in result["sweeps"].items()
                 if k.startswith(kind)]
        assert len({plan[0]["id"] for plan in plans}) == 1 and len(plans) == 4
        stored = {p.stem for p in (root / "out" / kind / "cells").glob("*.jsonl")}
        assert stored == {c["id"] for plan in plans for c in plan} and len(stored) <= 1 + 4 * 2 * 2 * 2
    assert len(list((root / "out" / "planted" / "cells").glob("*.jsonl"))) < 1 + 4 * 2 * 2 * 2


def test_tables_and_figure_are_written(calibrated):
    result, root = calibrated
    out = root / "out"
    saved = json.loads((out / "calibration.json").read_text())
    assert saved["headline"] == result["headline"] and len(saved["cells"]) == 2 * 4 * 2 * 2
    table = (out / "calibration.md").read_text()
    assert table.startswith(f"**{result['headline']}**")
    assert table.split("## Every cell")[1].count("\n| planted |") == 16
    assert table.split("## Recovery curve")[1].split("##")[0].count("\n| planted (multi_turn) |") == 16
    assert (out / "calibration.html").stat().st_size > 1000
    assert Path(result["figure"]["html"]).is_file()
    assert "Next: " in table.split("\n")[2]   # what to do with this status


def test_the_time_table_sums_each_stage_over_kinds_and_seeds(tmp_path):
    from rolemrc.organism.calibration import time_spent
    from rolemrc.organism.calibration_report import time_markdown

    for folder, stages in (("a", {"datagen": 10, "narration train dpo": 100, "null train dpo": 50}),
                           ("b", {"narration train dpo": 150, "narration probe last": 20})):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "stages.json").write_text(json.dumps({k: {"seconds": v} for k, v in stages.items()}))
    time = time_spent([tmp_path / "a", tmp_path / "b", tmp_path / "missing"], {"narration/frequency": {"seconds": 70}})
    assert [(t["stage"], t["runs"], t["seconds"]) for t in time] == [
        ("train dpo", 3, 300), ("sweep cells", 1, 70), ("probe last", 1, 20), ("datagen", 1, 10)]
    assert "| train dpo | 3 | 300 | 75% |" in time_markdown(time)


def test_a_rerun_reuses_every_stage(calibrated, monkeypatch):
    """Probes, diffs and attribution come from the stage cache, every sweep cell from its store: nothing is
    generated or collected again, and the rows are the same."""
    from rolemrc.core.stages import StageCache

    result, root = calibrated
    monkeypatch.setattr(sweep_plots, "write_sweep_figures", lambda summary, out: {})
    monkeypatch.setattr("rolemrc.sweep.sources.row_source", None)   # any generation would fail
    cache = StageCache(root / "out")
    again = calibrate([Organism(**o) for o in result["organisms"]], CalibrationConfig(**result["config"]), cache=cache)
    assert cache.ran == [] and json.dumps(again["cells"]) == json.dumps(result["cells"])   # NaN != NaN


def test_by_kl_the_planted_units_undo_the_change_and_random_units_do_not(calibrated_kl):
    """Scored by KL to the SFT model on its own replies: zeroing the 4 planted units takes the DPO model back to the
    SFT model (up to the noise both carry), its CI above 0 and above each of its matched random-unit controls,
    which undo next to nothing; no cell breaks anything (the held-out references' perplexity included)."""
    result, root = calibrated_kl
    planted = cells(result, "planted")
    for selector in ("standardized", "attribution"):
        (row,) = cells(result, "planted", selector, 0.0, 4)
        undone, controls = row["restoration"], row["controls_restoration"]
        assert row["measure"] == "kl" and row["units"] == 4 and undone["kl_dpo"] > 1 and undone["n"] == 12, row
        assert undone["share"] == pytest.approx(1, abs=0.01) and undone["lo"] > 0.9, row
        assert len(controls) == KL_CONTROLS and undone["lo"] > max(controls), row
        assert row["placement"]["percentile"] == 100 and row["placement"]["lo"] > 0.9, row
        assert row["p_vs_baseline"] < 0.05 and row["p_vs_controls"] < 0.05, row
        assert row["flagged"] == [DIMENSION] and finds_change(row), row
        assert "neutral_ppl" in row["others"], row   # the held-out references (out/planted/neutral.txt)
    assert all(abs(c) < 0.05 for r in planted for c in r["controls_restoration"])
    assert not any(r["broken"] for r in planted)
    assert (root / "out" / "planted" / "neutral.txt").read_text() == "a reference answer\n"


def test_by_kl_the_recommendation_is_a_selector_that_sees_the_change(calibrated_kl):
    result, root = calibrated_kl
    rec = result["recommendation"]
    assert rec["status"] == "found" and rec["selector"] in ("standardized", "attribution"), rec
    assert rec["budget"] == {"top_k": 4} and rec["factor"] == 0.0 and rec["rests_on"]["measure"] == "kl"
    assert "planted 100% undone (95% CI 100% to 100%)" in rec["why"]
    assert "Measure: teacher-forced KL to the SFT model" in result["headline"]
    assert "measure kl" in (root / "out" / "calibration.md").read_text()
    assert (root / "out" / "calibration.html").stat().st_size > 1000


def test_the_planted_organism_gets_a_frontier_with_its_known_units_as_the_ceiling(calibrated_kl):
    """Every kind on the planted pair; patch S and revert S (its known units) undo all of the change and their random
    controls none; the null organism, which plants nothing, has no frontier."""
    result, root = calibrated_kl
    assert set(result["frontiers"]) == {"planted"}
    frontier = result["frontiers"]["planted"]
    points = {p["family"]: p for p in frontier["points"]}
    assert {"patch S", "revert S", "direction", "revert model", "patch", "scale x0"} <= set(points)
    for family in ("patch S", "revert S"):
        assert points[family]["restoration"]["mean"] == pytest.approx(1, abs=1e-3)
        assert points[family]["controls"]["n"] == 10 and max(points[family]["controls"]["restoration"]) < 0.05
    assert "## Restraint frontiers" in (root / "out" / "calibration.md").read_text()
    assert Path(frontier["figures"]["frontier"]["html"]).is_file()


def test_by_kl_the_null_organism_flags_nothing(calibrated_kl):
    """The null's DPO model is the SFT model with other noise: its KL to it is a float32 rounding (below KL_FLOOR),
    so there is no change to undo and no cell is flagged, changed or broken."""
    result, _ = calibrated_kl
    null = cells(result, "null")
    assert len(null) == 4 * 2 and result["null_false_positive_rate"] == 0
    assert not any(r["flagged"] or r["changed"] or r["broken"] for r in null)
    assert all(abs(r["restoration"]["kl_dpo"]) < KL_FLOOR and r["unmoved"] == [DIMENSION] for r in null)
    assert all(r["p_vs_baseline"] is None and r["placement"] is None for r in null)   # no tests of rounding errors
    assert "Null organism: 0 of 8 cells flagged (0%" in result["headline"]


def test_by_kl_a_cell_breaks_what_it_pushes_away_from_the_sft_model_beyond_its_controls():
    """kl_verdicts on a sweep cell's Holm-corrected tests: role style restored beyond baseline and controls is
    flagged; knowledge boundary pushed away from the SFT model beyond the controls, and the neutral perplexity raised
    beyond theirs, are broken, so the cell does not find the change; a dimension with no change to undo counts in
    nothing."""
    def test(diff, p):
        return {"diff": diff, "p_holm": p}

    cell = {"scores": {
        "restoration:role_style": {"vs_baseline": test(0.9, 0.001), "vs_controls": test(0.8, 0.001)},
        "restoration:knowledge_boundary": {"vs_baseline": test(-0.4, 0.001), "vs_controls": test(-0.3, 0.002)},
        "restoration:nested": {"vs_baseline": test(0.2, 0.3), "vs_controls": test(-0.2, 0.4)},
        "neutral_ppl": {"vs_baseline": test(3.0, 0.01), "vs_controls": test(2.5, 0.01)}}}
    verdict = kl_verdicts(cell, "role_style", [])
    assert verdict == {"changed": ["knowledge_boundary", "role_style"], "flagged": ["role_style"],
                       "broken": ["knowledge_boundary", "neutral_ppl"]}
    assert not finds_change({"restoration": {"lo": 0.8}, "dimension": "role_style", **verdict})
    assert kl_verdicts(cell, "role_style", ["knowledge_boundary"])["broken"] == ["neutral_ppl"]
    assert kl_verdicts(cell, None, [])["broken"] == ["knowledge_boundary", "neutral_ppl"]   # the null: nothing planted


def test_restoration_share_and_interval():
    sft, dpo = {str(i): 1.0 for i in range(8)}, {str(i): 0.0 for i in range(8)}
    half = {str(i): float(i % 2) for i in range(8)}
    r = restoration(sft, dpo, half)
    assert r["share"] == 0.5 and r["n"] == 8 and 0 <= r["lo"] < 0.5 < r["hi"] <= 1
    assert math.isnan(restoration(sft, sft, half)["share"])


def test_a_cell_is_flagged_only_when_it_brings_cases_and_the_rate_back_to_the_sft_model():
    """As measured on SmolLM2: the planted DPO model fails most cases SFT passed but passes some SFT failed. A
    restraint that breaks the behaviour agrees with SFT on those (closer per case, p < 0.05) while its pass rate
    moves past SFT's: not flagged. One that restores the SFT model's cases is."""
    ids = range(64)
    sft = {"judge:role_style": {str(i): float(i % 16 < 12) for i in ids}}        # SFT passes 0.75
    dpo = {"judge:role_style": {str(i): float(i % 16 >= 12) for i in ids}}       # DPO 0.25, all of them SFT failed
    broken = {"judge:role_style": {str(i): 0.0 for i in ids}}
    restored = {"judge:role_style": dict(sft["judge:role_style"])}

    def row(cell):
        scores = [x["judge:role_style"] for x in (sft, dpo, cell)]
        return {"organism": "planted", "dimension": "role_style", "toward_sft": toward_sft(sft, dpo, cell, [dpo]),
                "restoration": restoration(*scores), "broken": []}

    rows = [row(broken), row(restored)]
    flag_restorations(rows)
    broke = rows[0]["toward_sft"]["role_style"]
    assert broke["vs_baseline"]["diff"] == -0.25 and broke["vs_baseline"]["p_holm"] < 0.05   # closer per case...
    assert broke["rate_gap"] == {"baseline": 0.5, "cell": 0.75, "controls": 0.5}            # ...not in the rate
    assert rows[0]["flagged"] == [] and not finds_change(rows[0])
    assert rows[1]["flagged"] == ["role_style"] and finds_change(rows[1])
    assert rows[1]["toward_sft"]["role_style"]["vs_controls"]["diff"] == -1


def test_the_paper_factor_runs_as_its_own_sweep_at_the_largest_budget_that_fits(tmp_path):
    """The default grid is the recovery curve, 16 to 1024 units per layer; budgets at or above the hook point's
    width (a smaller base) are left out."""
    curve = [Budget("per_layer", k) for k in (16, 64, 256, 1024)]
    assert sweeps(CalibrationConfig(out=str(tmp_path)), 1536) == {"": (curve, [0.0]), "-paper": (curve[3:], [PAPER_FACTOR])}
    assert sweeps(CalibrationConfig(out=str(tmp_path)), 1024) == {"": (curve[:3], [0.0]),
                                                                  "-paper": (curve[2:3], [PAPER_FACTOR])}
    assert sweeps(CalibrationConfig(out=str(tmp_path), paper_factor=False), 1536) == {"": (curve, [0.0])}
    assert sweeps(CalibrationConfig(out=str(tmp_path)), 16) == {}   # a base narrower than every budget: no cell runs
    assert headline([]).startswith("No cell ran: every budget was at or above the hook point's width")
    shares = CalibrationConfig(out=str(tmp_path), share=[0.5, 0.01])
    assert sweeps(shares, 8)["-paper"] == ([Budget("share", 0.5)], [PAPER_FACTOR])


def test_bad_grid_settings_are_errors_before_any_work(tmp_path):
    from rolemrc.core.errors import RolemrcError

    with pytest.raises(RolemrcError, match="unknown hook point 'mlp.nothing'"):
        CalibrationConfig(out=str(tmp_path), hook="mlp.nothing")
    with pytest.raises(RolemrcError, match=r"unknown selector 'best-guess'; choose from frequency"):
        CalibrationConfig(out=str(tmp_path), selectors=["standardized", "best-guess"])
    with pytest.raises(RolemrcError, match="choose at most one of --top-k/--per-layer/--share .given: --per-layer, --share"):
        CalibrationConfig(out=str(tmp_path), per_layer=[16], share=[0.1])
    assert not list(tmp_path.iterdir())


def test_a_restraint_that_breaks_a_dimension_is_not_counted_as_found():
    """As on SmolLM2's quick null organism (docs/calibration.md): zeroing attribution's top units drops role style
    0.79 -> 0.00. It brings no case back toward the SFT model (not flagged) and leaves the SFT model's CI: broken.
    On a planted organism a cell that undoes its change but breaks another dimension does not find it."""
    ids = [str(i) for i in range(24)]
    sft = {"judge:role_style": {i: float(k % 24 < 19) for k, i in enumerate(ids)}}
    null_dpo = {"judge:role_style": dict(sft["judge:role_style"])}
    broke = {"judge:role_style": dict.fromkeys(ids, 0.0)}
    row = {"organism": "null", "dimension": "role_style", "toward_sft": toward_sft(sft, null_dpo, broke, [null_dpo])}
    flag_restorations([row])
    assert row["flagged"] == []
    rates, baseline = {"role_style": 0.0, "knowledge_boundary": 0.12}, {"role_style": 0.79, "knowledge_boundary": 0.1}
    intervals = {"role_style": (0.62, 0.92), "knowledge_boundary": (0.0, 0.26), "nested": (0.0, 0.0)}
    assert broken(rates, baseline, intervals, [], None) == ["role_style"]
    assert broken(rates, baseline, intervals, [], "role_style") == []
    assert broken({"nested": 0.5}, {}, intervals, ["nested"], None) == ["nested"]   # a CI of no width: a change breaks
    assert broken({"nested": 0.5}, {}, intervals, [], None) == []
    # a dimension the DPO step already moved out of the SFT model's CI is broken only if the cell takes it further,
    # significantly: the narration organism's knowledge boundary (SFT 0.10, CI 0.03-0.17; DPO 0.00)
    kb = {"knowledge_boundary": (0.03, 0.17)}
    assert broken({"knowledge_boundary": 0.0}, {"knowledge_boundary": 0.0}, kb, [], "role_style") == []
    assert broken({"knowledge_boundary": 0.1}, {"knowledge_boundary": 0.0}, kb, [], "role_style") == []
    assert broken({"knowledge_boundary": 0.4}, {"knowledge_boundary": 0.3}, kb, [], "role_style") == []
    assert broken({"knowledge_boundary": 0.6}, {"knowledge_boundary": 0.3}, kb, ["knowledge_boundary"],
                  "role_style") == ["knowledge_boundary"]
    planted = {"restoration": {"lo": 0.4}, "dimension": "role_style", "flagged": ["role_style"], "broken": []}
    assert finds_change(planted) and not finds_change({**planted, "broken": ["knowledge_boundary"]})


def fake_row(kind, selector, per_layer, lo, *, dimension="role_style", found=True, broken=(), flagged=None):
    units = 30 * per_layer
    return {"organism": kind, "dimension": dimension, "selector": selector, "factor": 0.0, "units": units,
            "budget": {"per_layer": per_layer},
            "coverage": {"units": units, "share": units / 46080, "of": 46080,
                         "per_layer": {"min": per_layer, "median": per_layer, "max": per_layer}},
            "restoration": {"share": lo + 0.2, "lo": lo, "hi": min(1.0, lo + 0.4), "cell_minus_dpo": 0.1},
            "controls_restoration": [0.0], "controls_change": [0.0], "changed": [], "broken": list(broken),
            "flagged": ([dimension] if found else []) if flagged is None else flagged}


def test_a_recommendation_must_hold_on_every_planted_organism_the_null_and_other_settings(tmp_path):
    """found only where the recipe undoes both planted changes, leaves the null alone and another calibration (other
    settings) agrees; otherwise unstable with every reason and the settings it failed under."""
    probe = tmp_path / "probe.jsonl"
    write_jsonl(probe, [{"id": "a"}])
    organisms = [Organism(k, "s", "d", "p", str(probe), "e", str(probe), dim, {"steps": 32, "base": "smollm2"})
                 for k, dim in (("narration", "role_style"), ("refusal", "knowledge_boundary"), ("null", None))]
    config = CalibrationConfig(out=str(tmp_path / "c"))
    rows = [fake_row("narration", "attribution", 256, 0.7), fake_row("narration", "frequency", 256, 0.0, found=False),
            fake_row("refusal", "attribution", 256, 0.5, dimension="knowledge_boundary"),
            fake_row("refusal", "frequency", 256, 0.6, dimension="knowledge_boundary"),
            fake_row("null", "attribution", 256, 0.0, found=False), fake_row("null", "frequency", 256, 0.0, found=False)]
    rec = recommend(rows, organisms, config, [])
    assert rec.status == "found" and rec.selector == "attribution" and rec.budget == {"per_layer": 256}
    assert rec.why.startswith("attribution x0 at 7,680 units") and "narration 90% undone" in rec.why
    assert "refusal 70% undone (95% CI 50% to 90%)" in rec.why and rec.holds_over == [rec.rests_on]
    # the other settings' run (say --quick) did not find it on the narration organism, and there it broke the null
    quick = {"path": "runs/quick", "recommendation": {"rests_on": {"dpo_steps": 16, "probe_cases": 24}},
             "cells": [fake_row("narration", "attribution", 256, -2.1, found=False), rows[2],
                       fake_row("null", "attribution", 256, 0.0, found=False, broken=["role_style"])]}
    unstable = recommend(rows, organisms, config, [quick])
    assert unstable.status == "unstable" and unstable.selector == "attribution"
    assert "in runs/quick it did not undo narration -190% undone" in unstable.why
    assert "it moved role_style on the null" in unstable.why
    assert unstable.fails_over[0]["calibration"] == "runs/quick" and unstable.fails_over[0]["dpo_steps"] == 16
    # a recipe that undoes one planted change only, or breaks the null, is unstable
    one = recommend([rows[1], rows[3], rows[5]], organisms, config, [])
    assert one.status == "unstable" and "it did not undo the narration change (narration 20% undone" in one.why
    null_broken = recommend([*rows[:4], fake_row("null", "attribution", 256, 0.0, found=False, broken=["nested"])],
                            organisms, config, [])
    assert null_broken.status == "unstable" and "on the null organism it broke nested" in null_broken.why
    assert recommend(rows[1:2] + rows[4:], organisms, config, []).status == "none"
    # a planted kind asked for whose organism missed its target: the recipe was never tried on it, so never found
    alone = [o for o in organisms if o.kind != "narration"]
    refusal_only = recommend([r for r in rows if r["organism"] != "narration"], alone, config, [], missed=["narration"])
    assert refusal_only.status == "unstable" and refusal_only.selector == "frequency"
    assert "the narration organism missed its target and was left out" in refusal_only.why
    assert recommend([r for r in rows if r["organism"] != "narration"], alone, config, [], missed=["null"]).status == "found"


def test_the_recipe_chosen_on_the_selection_half_must_hold_on_the_confirmation_half(tmp_path):
    """recommend(selection=...): the recipe is the best on the selection half (frequency here, a winner's curse in
    the making), its numbers come from the confirmation half only, and where it does not undo the change there it is
    unstable; attribution, second on the selection half but confirmed, is not swapped in after the fact."""
    probe = tmp_path / "probe.jsonl"
    write_jsonl(probe, [{"id": "a"}])
    organisms = [Organism(k, "s", "d", "p", str(probe), "e", str(probe), dim, {"steps": 32, "base": "smollm2"})
                 for k, dim in (("narration", "role_style"), ("null", None))]
    config = CalibrationConfig(out=str(tmp_path / "c"))
    null = [fake_row("null", s, 256, 0.0, found=False) for s in ("frequency", "attribution")]
    selection = [fake_row("narration", "frequency", 256, 0.8), fake_row("narration", "attribution", 256, 0.5), *null]
    confirmed = [fake_row("narration", "frequency", 256, 0.6), fake_row("narration", "attribution", 256, 0.4), *null]
    rec = recommend(confirmed, organisms, config, [], selection=selection)
    assert rec.status == "found" and rec.selector == "frequency"
    assert "on the confirmation half: narration 80% undone (95% CI 60% to 100%)" in rec.why   # the second half's
    curse = [fake_row("narration", "frequency", 256, -0.1, found=False), confirmed[1], *null]
    unstable = recommend(curse, organisms, config, [], selection=selection)
    assert unstable.status == "unstable" and unstable.selector == "frequency"
    assert "it did not undo the narration change on the confirmation half (narration 10% undone" in unstable.why


def test_halves_are_disjoint_stratified_and_fixed_by_the_seed(tmp_path):
    """Every set of dimensions is dealt alternately after a seeded shuffle: both halves get each stratum's cases (an
    odd one's extra to the confirmation half), the neutral texts too, the same for the same seed."""
    from rolemrc.organism.halves import case_halves

    heldout, neutral = tmp_path / "heldout.jsonl", tmp_path / "neutral.txt"
    write_jsonl(heldout, [{"id": f"x{i}", "task": "role_related_mrc_answer_with_narration"} for i in range(7)]
                + [{"id": f"r{i}", "task": "role_related_mrc_refused_no_narration"} for i in range(4)])
    neutral.write_text("one\ntwo\n\nthree\n")
    halves = case_halves(heldout, neutral, 0)
    assert not halves["selection"] & halves["confirmation"]
    count = lambda half, prefix: sum(i.startswith(prefix) for i in halves[half])  # noqa: E731
    assert (count("selection", "x"), count("confirmation", "x")) == (3, 4)
    assert (count("selection", "r"), count("confirmation", "r")) == (2, 2)
    assert (count("selection", "neutral-"), count("confirmation", "neutral-")) == (1, 2)
    assert case_halves(heldout, neutral, 0) == halves and case_halves(heldout, neutral, 1) != halves


def test_over_seeds_a_recipe_must_lead_its_controls(tmp_path):
    """over_seeds: each seed's lead over its controls' median, with a t-interval over seeds; a lead whose interval
    reaches 0 makes a found recipe unstable in combine_seeds."""
    from rolemrc.organism.seeds import lead, over_seeds

    rows = [{**fake_row("narration", "attribution", 256, lo), "seed": s, "controls_restoration": ctrl}
            for s, lo, ctrl in ((0, 0.5, [0.1, 0.2, 0.3]), (1, 0.1, [0.3, 0.4]), (2, 0.3, [0.9, 0.0, 0.2]))]
    assert [lead(r) for r in rows] == pytest.approx([0.5, -0.05, 0.3])
    (o,) = over_seeds(rows, [0, 1, 2])
    assert o["gap"]["mean"] == pytest.approx(0.25) and o["gap"]["lo"] < 0 < o["gap"]["hi"] and o["found_in"] == "3 of 3"


def test_against_refuses_a_calibration_scored_before_breaking_was_checked(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "calibration.json").write_text(json.dumps({"kind": "calibration", "format": 1, "cells": [{"organism": "x"}],
                                                      "recommendation": {"status": "none", "why": "-"}}))
    with pytest.raises(OrganismError, match="written before cells were checked for broken dimensions; rerun"):
        load_calibration(old)


def test_stability_of_every_selection_is_reported_and_quoted_for_the_recipe(calibrated):
    """Every selector's units across 5 resamples of the probe cases (of the pairs for attribution), per organism,
    dimension and budget: standardized's 4 planted units are chosen in every resample of the planted organism."""
    result, root = calibrated
    rows = result["stability"]
    assert {(r["organism"], r["method"], r["budget"]) for r in rows} == {
        (o, s, b) for o in ("planted", "null") for s in ("frequency", "frequency-all", "standardized", "attribution")
        for b in ("top-4", "top-16")}
    assert all(r["resamples"] == 5 and r["dimension"] == DIMENSION for r in rows)
    (steady,) = [r for r in rows if (r["organism"], r["method"], r["budget"]) == ("planted", "standardized", "top-4")]
    assert steady["jaccard_mean"] == 1 and steady["chance"] < 0.1
    assert "its units in planted overlap 1.00 across 5 resamples (Jaccard; chance 0.03)" in result["recommendation"]["why"]
    assert "## Stability of the selections" in (root / "out" / "calibration.md").read_text()


def test_over_seeds_the_recipe_chosen_on_the_first_must_hold_on_every_other(calibrated, tmp_path):
    """combine_seeds: the first seed chooses, the others confirm. A second seed that agrees keeps the first seed's
    verdict; one whose cells no longer undo the change makes the recommendation `unstable`, naming that seed's folder."""
    import copy

    from rolemrc.organism.seeds import combine_seeds

    result, _ = calibrated
    first = result["recommendation"]
    agree = {0: result, 1: {**copy.deepcopy(result), "config": {**result["config"], "out": str(tmp_path / "seed-1")}}}
    both = combine_seeds(agree, tmp_path / "agree", [])
    assert both["recommendation"]["status"] == first["status"] and both["selection_seed"] == 0
    assert both["confirmation_seeds"] == [1] and {r["seed"] for r in both["cells"]} == {0, 1}
    assert len(both["cells"]) == 2 * len(result["cells"]) and (tmp_path / "agree" / "calibration.md").is_file()
    text = (tmp_path / "agree" / "calibration.md").read_text()
    assert "| planted@1 " in text and "## Over seeds" in text
    over = {(tuple(map(json.dumps, o["recipe"])), o["organism"]): o for o in both["over_seeds"]}
    assert len(over) == len({(r["selector"], json.dumps(r["budget"]), r["factor"]) for r in result["cells"]
                             if r["organism"] == "planted"})
    for o in over.values():   # two identical seeds: no spread, each seed's share is the mean
        assert o["shares"][0] == o["shares"][1] == o["mean"] and o["n"] == 2 and o["lo"] == o["hi"] == o["mean"]
    if first["status"] != "found":
        return
    lost = copy.deepcopy(agree[1])
    for row in lost["cells"]:
        row["restoration"]["lo"] = -1.0
    split = combine_seeds({0: result, 1: lost}, tmp_path / "split", [])
    assert split["recommendation"]["status"] == "unstable"
    assert f"in {tmp_path / 'seed-1'} it did not undo" in split["recommendation"]["why"]


RAY_DRIVER = """
import functools, json, os, subprocess, sys, tempfile
from pathlib import Path
from rolemrc.core.tasks import check_ray, run_tasks
from rolemrc.organism.calibration import probe_cases

ray, pairs, out = Path(sys.executable).parent / "ray", sys.argv[1], Path(sys.argv[2])
temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")   # short: Ray's unix sockets live under it
# one CPU: one worker process (Ray starts one per CPU, each ~6 CPU-s to start and import what its tasks run)
subprocess.run([ray, "start", "--head", "--node-ip-address=127.0.0.1", "--port=6390", "--num-cpus=1",
                "--include-dashboard=false", f"--temp-dir={temp}"], check=True, capture_output=True)
try:
    check_ray("127.0.0.1:6390")   # the real GCS passes the handshake
    seeds = run_tasks(functools.partial(probe_cases, Path(pairs), set(), 4), [0, 1, 2], ray="127.0.0.1:6390")
    pids = run_tasks(lambda _: os.getpid(), [0, 1], ray="127.0.0.1:6390")
    out.write_text(json.dumps({"seeds": seeds, "pids": pids}))
finally:
    subprocess.run([ray, "stop", "--force"], capture_output=True)
"""


@contextlib.contextmanager
def not_ray(answer: bytes | None) -> Iterator[int]:
    """A port on the loopback whose listener reads what each connection sends, writes `answer` (None: nothing) and
    closes it."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:   # the listener closed: the test is done
                return
            with conn:
                conn.recv(64)
                if answer is None:
                    time.sleep(1)
                else:
                    conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    with server:
        yield server.getsockname()[1]


def test_tasks_run_on_a_ray_cluster_as_in_process(calibrated, tmp_path):
    """run_tasks on a real Ray cluster (`ray start --head`, in a network namespace of its own so that it sees the
    loopback only): a seed's probe cases drawn as Ray tasks in worker processes equal those drawn here; an address
    nothing answers on, or something that is no Ray cluster answers on, is refused before any work."""
    import os
    import shutil
    import subprocess
    import sys

    from rolemrc.core.tasks import RayAddressError, check_ray, run_tasks

    _, root = calibrated
    pairs = root / "planted-pairs.jsonl"
    (tmp_path / "driver.py").write_text(RAY_DRIVER)
    unshare = shutil.which("unshare")
    assert unshare, "util-linux's unshare runs the cluster in a network namespace of its own"
    done = subprocess.run([unshare, "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "-", sys.executable,
                           str(tmp_path / "driver.py"), str(pairs), str(tmp_path / "remote.json")],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    remote = json.loads((tmp_path / "remote.json").read_text())
    here = run_tasks(functools.partial(probe_cases, pairs, set(), 4), [0, 1, 2])
    assert remote["seeds"] == here and here[0] != here[1]
    assert os.getpid() not in remote["pids"]
    with pytest.raises(RayAddressError, match="cannot be reached"):
        check_ray("127.0.0.1:1")
    for answer in (b"", b"HTTP/1.1 400 Bad Request\r\n\r\n", None):   # closes, speaks HTTP/1, says nothing
        with not_ray(answer) as port, pytest.raises(RayAddressError, match="not a Ray cluster"):
            check_ray(f"127.0.0.1:{port}", timeout=0.5)
    # an HTTP/2 peer that is no Ray cluster (as a proxy that answers every address): passes the handshake, then
    # Ray's own client, asked for the cluster's id, is refused
    with not_ray(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])) as port, pytest.raises(RayAddressError, match="no Ray cluster"):
        check_ray(f"127.0.0.1:{port}", answer_timeout=3)


def test_every_selector_is_scored_against_the_units_the_change_lives_in(calibrated):
    """The planted change lives in 4 known units of layer 1: detection per selector (one seed, so no interval), in
    calibration.json and calibration.md."""
    result, root = calibrated
    planted = result["detection"]["planted"]
    assert set(planted["summary"]) == set(CalibrationConfig(out="x").selectors) and len(planted["per_seed"]) == 1
    assert planted["per_seed"][0]["meets_target"]
    one = planted["per_seed"][0]["selectors"]
    assert all(0 <= one[s]["auroc"] <= 1 and one[s]["units_in_s"] == 4 for s in one)
    assert one["standardized"]["auroc"] > 0.9 and one["attribution"]["precision_at_s"] >= 0.5
    assert all(s["verdict"].startswith("not tested against chance (one seed") for s in planted["summary"].values())
    assert "null" not in result["detection"]
    text = (root / "out" / "calibration.md").read_text()
    assert "## Where the planted change lives: detection of its known units" in text and "| standardized |" in text


def test_a_units_organism_that_missed_its_target_is_read_for_detection_alone(calibrated, tmp_path):
    """Its S still carries its whole update: probed and scored against S, flagged as missed, no cell run on it."""
    result, _ = calibrated
    planted = next(Organism(**o) for o in result["organisms"] if o["kind"] == "planted")
    planted.meets_target, planted.headline = False, "planted organism MISSES its target: replies broken"
    config = CalibrationConfig(out=str(tmp_path), top_k=[4], paper_factor=False, attribution_pairs=6, max_new_tokens=6)
    alone = calibrate([], config, detect_only=[planted])
    assert alone["cells"] == [] and alone[RECOMMENDATION]["status"] == "none"
    row = alone["detection"]["planted"]["per_seed"][0]
    assert not row["meets_target"] and row["organism"] == planted.headline
    assert row["selectors"] == result["detection"]["planted"]["per_seed"][0]["selectors"]   # same probes, same S
    text = (tmp_path / "calibration.md").read_text()
    assert "missed its behavioural target in 1 of 1 seed(s)" in text
    assert "- seed 0: planted organism MISSES its target: replies broken" in text


def test_the_null_bounds_the_false_positive_rate_and_says_what_5_percent_needs(calibrated):
    result, root = calibrated
    null = [r for r in result["cells"] if r["organism"] == "null"]
    bound = result["null_bound"]
    assert bound["cells"] == len(null) > 0 and bound["flagged"] == sum(bool(r["flagged"] or r["broken"]) for r in null) == 0
    assert bound["upper_bound"] == pytest.approx(1 - 0.05 ** (1 / len(null)))   # 0 of n
    assert bound["cells_for_5pct"] == 59
    text = (root / "out" / "calibration.md").read_text()
    assert f"Null organism: {bound['flagged']} of {len(null)} cells moved a dimension beyond their controls" in text
    assert "needs 0 flagged of at least 59 null cells" in text   # the fixture's few null cells cannot reach 5%


def test_by_kl_the_recipe_is_chosen_on_one_half_and_reported_on_the_other(calibrated_kl):
    """The held-out cases are split (per dimension, with the seed) into a selection half, where the recommendation
    chooses, and a confirmation half, whose rows are the cells reported; the halves share no case, and each cell is
    measured on its half's cases alone."""
    from rolemrc.organism.halves import case_halves

    result, root = calibrated_kl
    organism = next(o for o in result["organisms"] if o["kind"] == "planted")
    halves = case_halves(organism["heldout"], root / "out" / "planted" / "neutral.txt", 0)
    assert not halves["selection"] & halves["confirmation"]
    assert sum(i.startswith("h") for i in halves["selection"]) == sum(i.startswith("h") for i in halves["confirmation"]) == 12
    chosen, reported = result["selection_cells"], result["cells"]
    assert {r["half"] for r in chosen} == {"selection"} and {r["half"] for r in reported} == {"confirmation"}
    key = lambda r: (r["organism"], r["selector"], json.dumps(r["budget"]), r["factor"], r["dimension"])  # noqa: E731
    assert sorted(map(key, chosen)) == sorted(map(key, reported))
    pairs = {key(r): r for r in chosen}
    moved = [(pairs[key(r)]["restoration"], r["restoration"]) for r in reported if r["organism"] == "null"]
    assert moved and all(a["n"] == b["n"] == 12 for a, b in moved)   # each on its half's cases, not all 24
    assert all(r["restoration"]["n"] == 12 for r in reported + chosen)


def test_by_kl_one_holm_family_per_organism_and_half_as_declared(calibrated_kl):
    """The planted organism's p-values of a half are Holm-corrected over every sweep's cells x scores on that half,
    in a family of the grid's declared cells (selectors x budgets x factors x dimensions) x scores: it does not change
    with how the grid is split into sweeps, nor with how many of them ran."""
    from rolemrc.core.stats import holm
    from rolemrc.organism.calibration_config import Organism
    from rolemrc.organism.halves import case_halves
    from rolemrc.organism.scoring import half_summary

    result, root = calibrated_kl
    organism = Organism(**next(o for o in result["organisms"] if o["kind"] == "planted"))
    items = case_halves(organism.heldout, root / "out" / "planted" / "neutral.txt", 0)["confirmation"]
    swept = {key.split("/")[1]: half_summary(json.loads((Path(folder) / "sweep.json").read_text()), Path(folder), items)
             for key, folder in result["sweeps"].items() if key.startswith("planted/")}
    selectors = CalibrationConfig(out="x").selectors
    assert len(swept) == len(selectors) > 1
    tests = [(selector, json.dumps(c["budget"]), c["factor"], name, e["vs_controls"])
             for selector, summary in swept.items() for c in summary["cells"] for name, e in c["scores"].items()
             if "vs_controls" in e]
    scores = len(next(iter(swept.values()))["cells"][0]["scores"])
    declared = len(selectors) * 2 * 1 * 1   # selectors x budgets (top-4, top-16) x factors (0) x dimensions
    assert len(tests) == declared * scores
    adjusted = holm([t[-1]["p"] for t in tests], declared * scores)
    by_cell = {(r["selector"], json.dumps(r["budget"]), r["factor"]): r for r in cells(result, "planted")}
    checked = 0
    for (selector, budget, factor, name, _), p_holm in zip(tests, adjusted):
        if name == "restoration:" + DIMENSION:
            assert by_cell[(selector, budget, factor)]["p_vs_controls"] == pytest.approx(p_holm), (selector, budget)
            checked += 1
    assert checked == len(by_cell)
    assert holm([0.01, 0.04], 4) == pytest.approx([0.04, 0.12])   # undeclared tests that did not run count as p = 1


def test_over_seeds_each_frontier_point_gets_a_t_interval_and_each_seed_a_leader():
    from rolemrc.organism.calibration_report import frontier_markdown
    from rolemrc.organism.seeds import frontier_over_seeds

    def seed(restored, leader):
        point = {"family": "patch", "per_layer": 16, "restoration": {"mean": restored}, "size": {"mean": 0.1},
                 "controls": {"excess": {"mean": restored - 0.1}}}
        model = {"family": "revert model", "alpha": 0.5, "restoration": {"mean": 0.4}, "size": {"mean": 0.2}}
        return {"frontiers": {"refusal": {"headline": "h", "points": [point, model], "figures": {},
                                          "matched": [{"leader": leader}, {"leader": leader}]}}}

    rows = frontier_over_seeds({0: seed(0.5, "patch"), 1: seed(0.7, "patch"), 2: seed(0.6, "revert model")})
    patch = next(r for r in rows if r["family"] == "patch")
    assert patch["setting"] == {"per_layer": 16} and patch["restoration"]["mean"] == pytest.approx(0.6)
    assert patch["restoration"]["lo"] < 0.6 < patch["restoration"]["hi"] and patch["excess"]["mean"] == pytest.approx(0.5)
    assert patch["leads"] == {"patch": 2, "revert model": 1}
    model = next(r for r in rows if r["family"] == "revert model")
    assert model["excess"]["n"] == 0   # no controls: the whole model
    text = "\n".join(frontier_markdown({"refusal@0": seed(0.5, "patch")["frontiers"]["refusal"]}, rows))
    assert "| refusal | patch | per_layer 16 | 0.600 [" in text and "patch led in 2 seed(s)" in text
