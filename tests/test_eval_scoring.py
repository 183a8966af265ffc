"""eval: verdict parsing, rule verifiers, aggregates on known answers, statistics, metrics vs the libraries."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.stats import mcnemar_outcomes, mean_ci, paired_test
from rolemrc.core.taxonomy import Aspect, judge_aspects_for_task
from rolemrc.eval import compare, parse_verdict, score
from rolemrc.eval.aggregate import aggregate
from rolemrc.eval.rules import find_rule, judge_item

PASSAGE = ("Help me with this text, would you?\n\nPassage 1: Contour lines on a map join points of equal height above "
           "sea level. Lines close together show steep ground.\n\nQuestion: What do contour lines join?")


def item(task: str, response: str, system: str = "You are Rosa, a surveyor.", reference: str | None = None, **kw):
    ref = reference or "(smiles) According to what is written here, points of equal height above sea level."
    return {"id": kw.get("id", task), "task": task, "reference": ref, "response": response,
            "question": [{"role": "system", "content": system}, {"role": "user", "content": PASSAGE}]}


@pytest.mark.parametrize("text, expected", [
    ("Score: 1", 1), ("1", 1), ("**1**", 1), ("Score: **0**", 0), ("The score is 0.", 0), ("score=0", 0),
    ("Reasoning: fine.\n\n1", 1), ("Final verdict: 1 (pass)", 1), ("Score: 1/1", 1), ("Rating: 0 out of 1", 0),
    ("Score: 10", None), ("Score: 0.5", None), ("Score: 1/10", None), ("Rating: 1 out of 10", None),
    ("Score: 1 or 0", None), ("Score: 1\nScore: 0", None), ("I think it is good", None), ("blah 1 blah", None),
    ("2", None), ("", None), (None, None),
])
def test_parse_verdict_adversarial(text, expected):
    assert parse_verdict(text) == expected


def test_rules_knowledge_answer_refusal_and_leak():
    kb = Aspect("knowledge_boundary", "within")
    answer_task = "role_related_mrc_answer_no_narration"
    assert judge_item(item(answer_task, "They join points of equal height above sea level."), kb).score == 1
    assert judge_item(item(answer_task, "I cannot answer that, sorry."), kb).score == 0
    assert judge_item(item(answer_task, "Contour lines join things on a map."), kb).score == 0  # echoes question only
    refuse_task = "role_related_mrc_refused_no_narration"
    refusal = item(refuse_task, "The text does not say, and I would rather not guess.", reference="It does not say.")
    assert judge_item(refusal, kb).score == 1
    leak = item(refuse_task, "I cannot say, but lines on a map join points of equal height.", reference="No.")
    verdict = judge_item(leak, kb)
    assert verdict.score == 0 and "copies the passage" in verdict.reason
    prio = Aspect("prioritized")
    assert judge_item(item(answer_task + "-refused", "I have been told not to answer that."), prio).score == 1
    assert judge_item(item(answer_task + "-refused", "Points of equal height above sea level."), prio).score == 0
    insist = item("role_unrelated_mrc_refused_no_narration-2ndanswer", "Fine: points of equal height above sea level.")
    assert judge_item(insist, Aspect("multi_turn", "answerable")).score == 1
    assert judge_item(dict(insist, response="Still no."), Aspect("multi_turn", "answerable")).score == 0


def test_rules_style_and_nested():
    style = Aspect("role_style")
    with_narr = "role_related_mrc_answer_with_narration"
    assert judge_item(item(with_narr, "(smiles) Points of equal height."), style).score == 1
    assert judge_item(item(with_narr, "Points of equal height."), style).score == 0
    no_narr = "role_related_mrc_refused_no_narration"
    assert judge_item(item(no_narr, "I will not guess."), style).score == 1
    assert judge_item(item(no_narr, "*sighs* I will not guess."), style).score == 0
    assert judge_item(item(no_narr, "Sure.\nUser: thanks"), style).score == 0
    nested = Aspect("nested")
    task = "role_related_mrc_answer_no_narration-special-format"
    cases = [("Formatting rule: Write your whole reply in capital letters.", "POINTS OF EQUAL HEIGHT.", "HEIGHT, mostly."),
             ("Formatting rule: Use no more than 5 words.", "Points of equal height.", "They join points of equal height above sea level."),
             ("Formatting rule: Do not use any commas.", "Points of equal height.", "Points, of equal height."),
             ("Formatting rule: Begin your reply with an emoji.", "\U0001F5FA Points of equal height.", "Points of equal height."),
             ("Formatting rule: Use the word 'lantern' at least once in your reply.", "By lantern light: points.", "Points."),
             ("Formatting rule: End your reply with the exact sentence: Stay curious!", "Points. Stay curious!", "Stay curious! Points.")]
    for system, good, bad in cases:
        assert judge_item(item(task, good, system=system), nested).score == 1, system
        assert judge_item(item(task, bad, system=system), nested).score == 0, system
    unknown = judge_item(item(task, "Points.", system="Formatting rule: reply as a sonnet."), nested)
    assert unknown.score is None and unknown.status == "unjudgeable"
    assert find_rule("Rule: write in lowercase please").kind == "lower"


def test_aggregates_on_known_answers():
    # items with known verdicts: knowledge 3/4, style 1/2, multi_turn 0/2, nested 2/2, prioritized 1/1 (+1 unparseable)
    rows = [("k", "knowledge_boundary", s) for s in (1, 1, 1, 0)] + [("s", "role_style", s) for s in (1, 0)]
    rows += [("m", "multi_turn", 0)] * 2 + [("n", "nested", 1)] * 2 + [("p", "prioritized", 1)]
    verdicts = [{"id": f"{p}{k}", "task": f"t-{d}", "dimension": d, "detail": None, "score": s, "status": "ok"}
                for k, (p, d, s) in enumerate(rows)]
    verdicts.append({"id": "x", "task": "t-prioritized", "dimension": "prioritized", "detail": None, "score": None,
                     "status": "unparseable"})
    agg = aggregate(verdicts, rounds=500)
    dims = {d: v["mean"] for d, v in agg["dimensions"].items()}
    assert dims == {"knowledge_boundary": 0.75, "role_style": 0.5, "multi_turn": 0.0, "nested": 1.0, "prioritized": 1.0}
    avg = {k: v["mean"] for k, v in agg["averages"].items()}
    assert avg["AvgSimple"] == pytest.approx((0.75 + 0.5 + 0 + 1 + 1) / 5)
    assert avg["AvgWeighted"] == pytest.approx(7 / 11)
    assert avg["AvgS(noMT)"] == pytest.approx((0.75 + 0.5 + 1 + 1) / 4)
    assert agg["status"] == {"ok": 11, "unparseable": 1} and agg["scored"] == 11
    for stat in (*agg["dimensions"].values(), *agg["averages"].values()):
        assert stat["lo"] <= stat["mean"] <= stat["hi"]
    assert agg["dimensions"]["nested"]["lo"] == agg["dimensions"]["nested"]["hi"] == 1.0


def test_mcnemar_on_known_table_and_paired_test():
    # 2x2 table: both 1: 10, a1 b0: 2, a0 b1: 9, both 0: 5 -> exact p = 2 * P(Bin(11, .5) <= 2) = 0.06543
    a = [1] * 10 + [1] * 2 + [0] * 9 + [0] * 5
    b = [1] * 10 + [0] * 2 + [1] * 9 + [0] * 5
    r = mcnemar_outcomes(a, b)
    assert (r["improved"], r["worsened"], r["n"]) == (9, 2, 26)
    assert r["p"] == pytest.approx(0.0654296875) and r["odds_ratio"] == pytest.approx(4.5)
    assert r["diff"] == pytest.approx(7 / 26)
    assert mcnemar_outcomes([1, 0], [1, 0])["p"] == 1.0
    rng = np.random.default_rng(0)
    x = rng.normal(size=200)
    shifted = paired_test(x, x + 0.5 + rng.normal(scale=0.1, size=200), rounds=2000)
    assert shifted["lo"] < 0.5 < shifted["hi"] and shifted["p"] < 0.001 and shifted["cohen_dz"] > 3
    same = paired_test(x, x + rng.normal(scale=0.1, size=200), rounds=2000)
    assert same["p"] > 0.05
    ci = mean_ci(x, rounds=2000)
    assert ci["lo"] < 0 < ci["hi"] and math.isclose(ci["mean"], x.mean())
    half = (ci["hi"] - ci["lo"]) / 2
    assert half == pytest.approx(1.96 * x.std(ddof=1) / np.sqrt(x.size), rel=0.15)


def test_metrics_match_libraries():
    import sacrebleu
    from bert_score import score as bert
    from nltk.translate.meteor_score import meteor_score
    from rouge_score import rouge_scorer

    from rolemrc.eval.metrics import MetricConfig, bertscore_model, compute, tokens

    hyps = ["the cat was sitting on the mat. it purred.", "a dog barked at the mailman", ""]
    refs = ["the cat sat on the mat. it was purring.", "the dog barks at the postman", "an empty reply"]
    result = compute(hyps, refs, MetricConfig())
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)
    for k, (h, r) in enumerate(zip(hyps, refs)):
        assert result.values["bleu"][k] == pytest.approx(sacrebleu.sentence_bleu(h, [r]).score)
        direct = scorer.score(r.replace(". ", ".\n"), h.replace(". ", ".\n"))
        for name in ("rouge1", "rouge2", "rougeL", "rougeLsum"):
            assert result.values[name][k] == pytest.approx(direct[name].fmeasure)
        assert result.values["meteor"][k] == pytest.approx(meteor_score([tokens(r)], tokens(h)))
    model, layer = bertscore_model(MetricConfig())
    assert layer == 5 and "minilm" in model.lower()
    _, _, f1 = bert(hyps[:2], refs[:2], model_type=model, num_layers=layer)
    assert result.values["bertscore"][:2] == pytest.approx([float(v) for v in f1], abs=1e-5)
    assert result.values["bertscore"][2] == 0.0
    assert result.values["meteor"][0] > result.values["meteor"][1] > 0
    assert "layer 5" in result.info["bertscore"]


def test_meteor_missing_wordnet_reported(tmp_path, monkeypatch):
    from rolemrc.eval import metrics

    monkeypatch.setenv("ROLEMRC_WORDNET", str(tmp_path / "absent"))
    result = metrics.compute(["a b"], ["a b"], metrics.MetricConfig(groups=("bleu", "meteor")))
    assert "meteor" not in result.values and "wordnet-base" in result.unavailable["meteor"]
    assert result.values["bleu"] == [pytest.approx(sacrebleu_score("a b", "a b"))]


def sacrebleu_score(h: str, r: str) -> float:
    import sacrebleu

    return sacrebleu.sentence_bleu(h, [r]).score


def test_score_and_compare_end_to_end(records, tmp_path):
    good = [dict(r, response=r["reference"]) for r in records]
    bad = [dict(r, response="Hello there.") for r in records]
    run_a = score(good, metrics=("bleu",), rounds=300)
    run_b = score(bad, metrics=("bleu",), rounds=300)
    calls = sum(len(judge_aspects_for_task(r["task"])) for r in records)
    assert run_a.summary["judge_aggregates"]["calls"] == calls == len(run_a.verdicts)
    run_a.save(tmp_path / "a", chart=False)
    run_b.save(tmp_path / "b", chart=False)
    result = compare(tmp_path / "a", tmp_path / "b", rounds=300)
    assert result.shared_items == len(records)
    assert result.metrics["bleu"]["diff"] < 0 and result.metrics["bleu"]["hi"] < 0
    out = result.save(tmp_path / "cmp", chart=False)
    text = (out / "compare.md").read_text()
    assert "Table 6" in text and "| all |" in text
    rows = {d: r for d, r in result.verdicts.items() if d != "all"}
    cost = result.costliest()
    assert cost["dimension"] == min(rows, key=lambda d: rows[d]["diff"]) and cost["diff"] == rows[cost["dimension"]]["diff"]
    assert cost["lo"] <= cost["diff"] <= cost["hi"] < 0 and cost["excludes_zero"]
    assert f"Costliest dimension: {cost['dimension']}" in text and "its CI excludes 0" in text
    assert json.loads((out / "compare.json").read_text())["costliest"]["dimension"] == cost["dimension"]
    runner = CliRunner()
    named = runner.invoke(app, ["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--costliest", "--rounds", "200"])
    assert named.exit_code == 0 and named.stdout == cost["dimension"] + "\n", named.output
    assert "Costliest dimension" in named.stderr
    assert "Table 3" in (tmp_path / "a" / "report.md").read_text()
    with pytest.raises(ValueError, match="lacks"):
        score([{"id": "x", "task": "t"}], metrics=None)


def test_a_change_ci_resamples_items_not_verdicts():
    """An item's verdicts move together: with every item judged on three details alike, the CI of the change is the
    one-verdict-per-item CI (the same bootstrap of the per-item change), not three times as many independent draws."""
    from rolemrc.eval.compare import item_resampled_ci

    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 2, 30), rng.integers(0, 2, 30)
    keys = [(f"i{i}", "nested", d) for i in range(30) for d in ("x", "y", "z")]
    va = {k: int(a[int(k[0][1:])]) for k in keys}
    vb = {k: int(b[int(k[0][1:])]) for k in keys}
    lo, hi = item_resampled_ci(keys, va, vb, rounds=2000, seed=0)
    once = mean_ci(b - a, rounds=2000, seed=0)
    assert (lo, hi) == pytest.approx((once["lo"], once["hi"]))
    flat = mean_ci([vb[k] - va[k] for k in keys], rounds=2000, seed=0)   # verdicts as if independent: too narrow
    assert flat["hi"] - flat["lo"] < 0.8 * (hi - lo)
