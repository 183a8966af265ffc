"""scripts/docs_pictures.py's page block: docs/demo.md's figures of the demo's run are rewritten from that run's files
(summary.json, stages.json, the SFT and DPO evals, the sweep's scores), between one pair of markers, and nothing else
on the page changes. The fake run here is built with the demo's own report functions on a few items: no model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rolemrc.core.io import write_jsonl
from rolemrc.core.stats import mean_ci
from rolemrc.demo.report import headline, results_markdown, verdict_sentence
from rolemrc.eval.aggregate import aggregate
from rolemrc.eval.compare import compare
from rolemrc.eval.runs import EvalRun
from rolemrc.intervene.spec import PAPER_FACTOR
from rolemrc.sweep.report import headline as sweep_headline
from rolemrc.sweep.stats import cell_effects, correct_grid

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import docs_pictures  # noqa: E402  (scripts/ is no package)

IDS = [f"persona-{k:03d}/multi_turn" for k in range(8)]
ROUNDS = 200   # bootstrap rounds: the numbers only need to be the run's, not precise


def eval_run(folder: Path, passes: list[int], bleu: list[float]) -> Path:
    """An eval folder as `eval run` saves it: one multi_turn verdict and a BLEU value per item."""
    items = [{"id": i, "task": "multi_turn", "question": "q", "reference": "r", "response": f"reply {k}"}
             for k, i in enumerate(IDS)]
    verdicts = [{"id": i, "task": "multi_turn", "dimension": "multi_turn", "detail": None, "score": s, "status": "ok",
                 "reason": "", "raw": None, "damage": None} for i, s in zip(IDS, passes)]
    metrics = [{"id": i, "bleu": b} for i, b in zip(IDS, bleu)]
    summary = {"n_items": len(IDS), "metrics": {"bleu": mean_ci(bleu, rounds=ROUNDS)},
               "judge_aggregates": aggregate(verdicts, rounds=ROUNDS)}
    return EvalRun(items, metrics, verdicts, summary).save(folder, chart=False)


def sweep(out: Path) -> dict:
    """The sweep's summary entry: a paper-factor cell that changes nothing and a zeroing cell that moves multi-turn
    and BLEU, each against the baseline and one control, Holm-corrected over the grid; their responses on disk."""
    ids = IDS[:4]
    base = {"judge:multi_turn": dict(zip(ids, [0.0, 0.0, 1.0, 0.0])), "bleu": dict(zip(ids, [10.0, 20.0, 30.0, 40.0])),
            "rouge1": dict(zip(ids, [0.2, 0.3, 0.4, 0.5]))}
    zeroed = {"judge:multi_turn": dict(zip(ids, [1.0, 1.0, 1.0, 1.0])), "bleu": dict(zip(ids, [12.0, 22.0, 33.0, 41.0])),
              "rouge1": dict(zip(ids, [0.1, 0.3, 0.5, 0.5]))}
    control = {name: dict(values) for name, values in base.items()}
    effects = {"selected-paper": cell_effects(base, base, [control], rounds=ROUNDS),
               "selected-zero": cell_effects(base, zeroed, [control], rounds=ROUNDS)}
    correct_grid(effects)
    grid = {"selected-paper": (PAPER_FACTOR, 3.8e-6), "selected-zero": (0.0, 2.4)}
    cells = [{"id": cid, "dimension": "multi_turn", "factor": factor, "budget": {"top_k": 4}, "units": 4,
              "weight_elements_changed": 48, "max_logit_shift": shift, "coverage": None, "scores": effects[cid]}
             for cid, (factor, shift) in grid.items()]
    replies = {"baseline-0": "same", "selected-paper": "same", "selected-zero": "other"}
    for folder, reply in replies.items():
        write_jsonl(out / "scores" / folder / "responses.jsonl", [{"id": i, "response": f"{reply} {i}"} for i in ids])
    return {"out": str(out), "headline": sweep_headline(cells), "cells": cells, "figures": {}, "items": len(ids)}


@pytest.fixture
def demo(tmp_path) -> Path:
    """A demo folder with what the page block reads: summary.json, stages.json, eval/sft, eval/dpo, sweep/scores."""
    out = tmp_path / "demo"
    runs = {"sft": eval_run(out / "eval" / "sft", [0, 1, 0, 0, 1, 0, 0, 0], [10.0, 12.0, 8.0, 9.0, 11.0, 10.0, 7.0, 9.0]),
            "dpo": eval_run(out / "eval" / "dpo", [1, 1, 0, 1, 1, 0, 0, 0], [11.0, 13.0, 9.0, 9.5, 12.0, 10.5, 8.0, 9.5])}
    comparison = {"verdicts": {"multi_turn": {"a_rate": 0.5, "b_rate": 0.5, "p": 1.0, "improved": 0, "worsened": 0}},
                  "metrics": {"bleu": {"diff": 0.0, "lo": 0.0, "hi": 0.0, "p": 1.0}}}
    check = {"units": 4, "verdict": "ok", "weight_elements_changed": 48, "hook_vs_original_max_abs": 3.1e-6}
    conclusion = verdict_sentence(comparison, check, "The restraint (4 units x 0.999999)")
    stage_seconds = {"datagen": 3.1, "train base": 40.2, "eval sft": 12.3, "eval dpo": 17.6, "probe sft+dpo": 5.0,
                     "probe diff": 1.2, "explorer": 0.1, "restraint select": 0.0, "restraint bake": 0.2,
                     "restraint check": 0.4, "restraint lora": 2.0}
    summary = {"out": str(out), "base": "embedded", "test_cases": len(IDS),
               "eval": {name: headline(run) for name, run in runs.items()},
               "largest_shift": {"dimension": "multi_turn", "cases_a": 6, "cases_b": 6, "mean_abs_delta": 0.031,
                                 "significant_units": 2, "significant_effect_units": 3, "peak_layer": 1,
                                 "peak_layer_mean_abs_delta": 0.04},
               "restraint_effects": {"restraint": {"factor": PAPER_FACTOR, "units": 4, "conclusion": conclusion}},
               "conclusion": conclusion, "sweep": sweep(out / "sweep"), "stage_seconds": stage_seconds,
               "stages_run": [name for name in stage_seconds if name != "restraint select"]}   # select was reused
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "results.md").write_text(results_markdown(summary))
    (out / "stages.json").write_text(json.dumps({"restraint select": {"key": "k", "result": {}, "seconds": 3.0}}))
    return out


def flat(text: str) -> str:
    return " ".join(text.split())


def test_the_demo_page_block_is_rewritten_from_the_run_and_nothing_else(demo, tmp_path):
    page = tmp_path / "demo.md"
    page.write_text((ROOT / "docs" / "demo.md").read_text())
    outside = page.read_text().split(docs_pictures.DEMO_RUN_START)[0], page.read_text().split(docs_pictures.DEMO_RUN_END)[1]

    docs_pictures.write_demo_page(demo, page)
    text = page.read_text()
    before, rest = text.split(docs_pictures.DEMO_RUN_START)
    block, after = rest.split(docs_pictures.DEMO_RUN_END)
    assert (before, after) == outside
    summary = json.loads((demo / "summary.json").read_text())
    block = flat(block)
    assert flat(summary["conclusion"]) in block and "max logit shift 3.10e-06" in block
    assert flat(f"Sweep: {summary['sweep']['headline']}") in block
    assert flat(summary["sweep"]["headline"]) in flat((demo / "results.md").read_text())   # as results.md says it
    change = compare(demo / "eval" / "sft", demo / "eval" / "dpo").verdicts["all"]
    assert change["diff"] == pytest.approx(0.25)
    assert (f"The judge average over calls is 0.250 under SFT and 0.500 under DPO (paired change +0.250, 95% CI "
            f"{docs_pictures.signed(change['lo'], 3)} to {docs_pictures.signed(change['hi'], 3)}), and every reference "
            "metric is higher under DPO.") in block
    assert "The 1 - 1e-6 cells move logits by at most 4e-6 and change no response." in block
    assert ("Zeroing the top 4 units raises multi-turn passes by 0.75 (4 cases) and BLEU by 2.00 against the baseline, "
            "but with 4 cases and 6 tests per family, nothing survives Holm") in block
    assert "The dimension with the largest mean shift is `multi_turn` (6 probe cases), peaking at layer 1." in block
    # the stage table: a reused stage timed as when it ran (stages.json), a stage no row names in a row of its own
    for row in ("| datagen | 3 s |", "| eval sft / dpo | 12-18 s each |", "| probe | 6 s |", "| restraint | 4 s |",
                "| restraint lora | 2 s |", "The stages took 85 s in all."):
        assert row in block
    assert "0.38" not in block and "| serve |" not in block   # nothing of the page's earlier run is left

    docs_pictures.write_demo_page(demo, page)
    assert page.read_text() == text   # a second rewrite from the same run changes nothing


def test_a_page_without_one_marker_pair_is_refused(demo, tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Demos\n\nno block here\n")
    with pytest.raises(SystemExit, match="exactly one"):
        docs_pictures.write_demo_page(demo, page)
    assert page.read_text() == "# Demos\n\nno block here\n"


def test_the_demo_page_has_exactly_one_generated_block():
    text = (ROOT / "docs" / "demo.md").read_text()
    start, end = docs_pictures.DEMO_RUN_START, docs_pictures.DEMO_RUN_END
    assert text.count(start) == 1 and text.count(end) == 1 and text.index(start) < text.index(end)
