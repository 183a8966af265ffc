"""eval.damage: empty, degenerate and wrong-language replies fail every aspect, whichever the judge, and are counted."""

from __future__ import annotations

import json

import pytest

from rolemrc.core.taxonomy import TASKS, judge_aspects_for_task
from rolemrc.eval import compare, judge, register_judge, score
from rolemrc.eval.damage import damage
from rolemrc.eval.judges import JUDGES, JudgeConfig
from rolemrc.eval.verdicts import Verdict

PASSAGE = ("Help me with this text, would you?\n\nPassage 1: Contour lines on a map join points of equal height above "
           "sea level. Lines close together show steep ground.\n\nQuestion: What do contour lines join?")
SYSTEM = "You are Rosa, a surveyor."
BROKEN = ". is is is is is is is is is is is is is is is is is is is is…"   # every MLP unit zeroed
FRENCH = "Je ne sais pas, mon ami. La carte ne dit rien de cela et je préfère ne pas deviner."


def item(task: str, response: str, system: str = SYSTEM, **kw) -> dict:
    return {"id": kw.get("id", task), "task": task, "response": response,
            "reference": "(smiles) According to what is written here, points of equal height above sea level.",
            "question": [{"role": "system", "content": system}, {"role": "user", "content": PASSAGE}]}


@pytest.mark.parametrize("reply, kind", [
    ("", "empty"), ("   \n", "empty"), ("... ?!", "empty"), ("\U0001F30A\U0001F30A", "empty"),
    (BROKEN, "degenerate"), (". is is is is is", "degenerate"), ("the tide turns the tide turns the tide turns", "degenerate"),
    ("Well, ha ha ha ha ha, no.", "degenerate"), ("ha ho ha ho ha ho ha", "degenerate"),
    ("!!! ??? ... ;;; ,,, ::: --- a", "degenerate"),
    ("(laughs) (smiles)\n\n(chuckles)\n\n(taps fingers)", "empty"),   # SmolLM2 after 16 narration DPO steps
    ("(pauses, looks at you)\n*laughs*\n[smiles]\n(chuck", "empty"),   # the last cut off by the token limit
    ("(smiles)", "empty"), ("*nods* (laughs)", "empty"), ("(smiles)\n\n(laughs", "empty"),   # acts, says nothing
    (FRENCH, "wrong_language"), ("Я не знаю ответа на этот вопрос, мой друг, спросите кого-нибудь другого.", "wrong_language"),
])
def test_damaged_replies(reply, kind):
    assert damage(reply, PASSAGE, SYSTEM).kind == kind


@pytest.mark.parametrize("reply", [
    "(smiles) Points of equal height above sea level, my friend. I walked those lines for years.",
    "the tide turns the tide turns, and then it rests.", "Ha ha ha ha! Points of equal height.", "No, no, no, no.",
    "Well... I... I don't know. (looks away) The passage doesn't say, and I would rather not guess.",
    "\U0001F5FA POINTS OF EQUAL HEIGHT! \U0001F30A\U0001F30A", "Oui, merci.", "Je ne sais pas, mon ami.",
    "One of the lines, one of the hills, one of the days: contour lines join points of equal height.",
    "(smiles) (nods) (laughs) Points of equal height.", "*nods* Yes.", "(laughs) No.",
])
def test_normal_and_short_replies_are_not_damaged(reply):
    assert damage(reply, PASSAGE, SYSTEM) is None


def test_a_language_a_rule_asks_for_and_the_prompts_language_are_never_wrong():
    french_rule = SYSTEM + "\nFormatting rule: Answer in French."
    assert damage(FRENCH, PASSAGE, french_rule) is None
    assert damage("The passage says they join points of equal height above sea level.", PASSAGE, french_rule) is None
    assert damage(FRENCH, "Bonjour, que disent les lignes de niveau sur la carte ?", "") is None
    assert damage(FRENCH, "Hi.", "") is None                         # the prompt's language cannot be told
    why = damage(FRENCH, PASSAGE, SYSTEM + "\nFormatting rule: Answer in German.")
    assert why.kind == "wrong_language" and "not English (the prompt's)" in why.detail and "not German" in why.detail


def test_a_broken_reply_fails_every_dimension():
    items = [item(task, BROKEN) for task in TASKS]
    verdicts = judge(items)
    assert {v.dimension for v in verdicts} == {"knowledge_boundary", "role_style", "multi_turn", "nested", "prioritized"}
    for v in verdicts:
        assert (v.score, v.status, v.damage) == (0, "ok", "degenerate"), v
        assert v.reason == "damaged reply: degenerate (loops on 'is' from word 1)"


def test_an_in_character_reply_passes_role_style_as_before():
    said = "Points of equal height above sea level, my friend."
    for task, reply in (("role_related_mrc_answer_with_narration", f"(smiles) {said}"),
                        ("role_unrelated_mrc_answer_no_narration", said)):
        [style] = [v for v in judge([item(task, reply)]) if v.dimension == "role_style"]
        assert style.score == 1 and style.damage is None and style.reason in ("narration present", "speech only")


def test_no_judge_is_asked_about_a_damaged_reply():
    asked = []

    @register_judge("yes")
    def yes(calls, config, progress) -> list[Verdict]:
        """1 for every call."""
        asked.extend(item["id"] for item, _ in calls)
        return [Verdict.make(item["id"], item["task"], aspect, 1) for item, aspect in calls]

    try:
        task = "role_related_mrc_answer_with_narration"
        items = [item(task, "(nods) Points of equal height.", id="ok"), item(task, "", id="empty"),
                 item(task, FRENCH, id="french")]
        verdicts = judge(items, JudgeConfig(name="yes"))
    finally:
        JUDGES.unregister("yes")
    assert set(asked) == {"ok"}
    assert {(v.id, v.score, v.damage) for v in verdicts} == {("ok", 1, None), ("empty", 0, "empty"),
                                                              ("french", 0, "wrong_language")}


def test_the_damaged_share_is_an_aggregate_of_the_run_and_of_compare(tmp_path):
    tasks = [t for t in TASKS if judge_aspects_for_task(t)][:8]
    intact = [item(t, "(nods) Points of equal height above sea level.", id=f"i{k}") for k, t in enumerate(tasks)]
    broken = [dict(x, response=BROKEN if k % 2 else "") for k, x in enumerate(intact)]
    score(intact, metrics=None, rounds=200).save(tmp_path / "a", chart=False)
    score(broken[:4] + intact[4:], metrics=None, rounds=200).save(tmp_path / "b", chart=False)
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    share = report["judge_aggregates"]["damaged"]
    assert share["mean"] == 0.5 and share["n"] == 8 and share["kinds"] == {"empty": 2, "degenerate": 2}
    assert 0 <= share["lo"] <= share["mean"] <= share["hi"] <= 1
    assert json.loads((tmp_path / "a" / "report.json").read_text())["judge_aggregates"]["damaged"]["mean"] == 0
    text = (tmp_path / "b" / "report.md").read_text()
    assert "| damaged |" in text and "Damaged replies" in text and "50.0 [" in text
    result = compare(tmp_path / "a", tmp_path / "b", rounds=200)
    assert (result.damaged["improved"], result.damaged["worsened"], result.damaged["b_rate"]) == (4, 0, 0.5)
    assert "## Damaged replies" in (result.save(tmp_path / "cmp", chart=False) / "compare.md").read_text()
