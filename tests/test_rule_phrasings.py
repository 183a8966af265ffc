"""The rules judge on rule phrasings no rolemrc generator writes (tests/data/rule_phrasings.jsonl): every verdict
right, or unjudgeable where the row says so; never a wrong verdict."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from rolemrc.core.io import read_jsonl
from rolemrc.core.taxonomy import Aspect
from rolemrc.eval.rules import judge_item

PHRASINGS = Path(__file__).parent / "data" / "rule_phrasings.jsonl"
WANT = {"obeys": 1, "breaks": 0}


def verdict(rule: str, reply: str):
    item = {"id": "x", "task": "role_related_mrc_answer_no_narration-special-format", "reference": "The tide is out.",
            "response": reply, "question": [
                {"role": "system", "content": f"You are Rosa, a harbour pilot.\n\nFormatting rule: {rule}"},
                {"role": "user", "content": "Question: Is the tide out?"}]}
    return judge_item(item, Aspect("nested"))


def outcome(row: dict) -> tuple[str, str]:
    """('right' | 'unjudgeable' | 'wrong' | 'unexpected', why) for one row: both replies judged right, both
    unjudgeable, a verdict that contradicts its reply, or a coverage other than the row's `expect`."""
    verdicts = {reply: verdict(row["rule"], row[reply]) for reply in WANT}
    wrong = [f"{reply} reply scored {v.score}: {v.reason}" for reply, v in verdicts.items()
             if v.score is not None and v.score != WANT[reply]]
    if wrong:
        return "wrong", "; ".join(wrong)
    judged = [v.score is not None for v in verdicts.values()]
    got = "right" if all(judged) else "unjudgeable" if not any(judged) else "unexpected"
    expect = "unjudgeable" if row.get("expect") == "unjudgeable" else "right"
    why = "; ".join(f"{reply}: {v.status} {v.reason}" for reply, v in verdicts.items())
    return (got, why) if got == expect else ("unexpected", f"expected {expect}: {why}")


def test_every_verdict_is_right_or_unjudgeable():
    rows = read_jsonl(PHRASINGS)
    results = [(row["rule"], *outcome(row)) for row in rows]
    counts = Counter(kind for _, kind, _ in results)
    print(f"\n{len(rows)} phrasings: {counts['right']} judged right, {counts['unjudgeable']} unjudgeable, "
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
