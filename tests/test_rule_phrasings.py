"""The rules judge on rule phrasings no rolemrc generator writes (tests/data/rule_phrasings.jsonl): every verdict
right, or unjudgeable where the row says so; never a wrong verdict. Each rule is stated both ways a system prompt
can: on a `Formatting rule:` line, and on a line of the role's description."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from rolemrc.core.io import read_jsonl
from rolemrc.core.taxonomy import Aspect
from rolemrc.eval.rules import judge_item

PHRASINGS = Path(__file__).parent / "data" / "rule_phrasings.jsonl"
WANT = {"obeys": 1, "breaks": 0}
PLACEMENTS = {"rule line": "You are Rosa, a harbour pilot.\n\nFormatting rule: {}",
              "in the description": "You are Rosa, a harbour pilot.\n{}\nYou know every tide table by heart."}


def verdict(system: str, reply: str):
    item = {"id": "x", "task": "role_related_mrc_answer_no_narration-special-format", "reference": "The tide is out.",
            "response": reply, "question": [{"role": "system", "content": system},
                                            {"role": "user", "content": "Question: Is the tide out?"}]}
    return judge_item(item, Aspect("nested"))


def outcome(row: dict, placement: str = "rule line") -> tuple[str, str]:
    """('right' | 'unjudgeable' | 'wrong' | 'unexpected', why) for one row: both replies judged right, both
    unjudgeable, a verdict that contradicts its reply, or a coverage other than the row's `expect`."""
    system = PLACEMENTS[placement].format(row["rule"])
    verdicts = {reply: verdict(system, row[reply]) for reply in WANT}
    wrong = [f"{reply} reply scored {v.score}: {v.reason}" for reply, v in verdicts.items()
             if v.score is not None and v.score != WANT[reply]]
    if wrong:
        return "wrong", "; ".join(wrong)
    judged = [v.score is not None for v in verdicts.values()]
    got = "right" if all(judged) else "unjudgeable" if not any(judged) else "unexpected"
    expect = "unjudgeable" if row.get("expect") == "unjudgeable" else "right"
    why = "; ".join(f"{reply}: {v.status} {v.reason}" for reply, v in verdicts.items())
    return (got, why) if got == expect else ("unexpected", f"expected {expect}: {why}")


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_verdict_is_right_or_unjudgeable(placement):
    rows = read_jsonl(PHRASINGS)
    results = [(row["rule"], *outcome(row, placement)) for row in rows]
    counts = Counter(kind for _, kind, _ in results)
    print(f"\n{len(rows)} phrasings ({placement}): {counts['right']} judged right, {counts['unjudgeable']} unjudgeable, "
          f"{counts['wrong']} wrong, {counts['unexpected']} unexpected")
    assert len(rows) >= 60
    assert [(rule, why) for rule, kind, why in results if kind == "wrong"] == []
    assert [(rule, why) for rule, kind, why in results if kind == "unexpected"] == []


def test_a_wrong_verdict_or_a_lost_rule_fails_the_set():
    row = {"rule": "Sprinkle at least two emojis through your reply.", "obeys": "Out 🌊 now 🐚", "breaks": "Out 🌊."}
    assert outcome(row)[0] == "right"
    assert outcome({**row, "obeys": row["breaks"], "breaks": row["obeys"]})[0] == "wrong"
    assert outcome({**row, "expect": "unjudgeable"})[0] == "unexpected"
    assert outcome({**row, "rule": "Mention your childhood."})[0] == "unexpected"


def test_a_phrase_to_end_with_that_runs_on_into_the_description_is_unjudgeable():
    system = "You are Rosa, a harbour pilot. Sign off with the line: Yours at sea, Rosa You know every tide table."
    assert verdict(system, "The tide is out. Yours at sea, Rosa").status == "unjudgeable"
    two = "Formatting rule: End your reply with the exact sentence: Stay curious! You know every tide table."
    assert verdict(two, "The tide is out. Stay curious!").status == "unjudgeable"
