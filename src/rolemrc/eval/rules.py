"""The `rules` judge: deterministic verifiers for what can be checked exactly, offline.

Per aspect, what it judges and what it cannot:

- knowledge_boundary (within / outside): whether the reply *behaves* as the task requires. Tasks
  named `*_answer_*` must answer: at least half of the reference's evidence words (content words the
  reference shares with the user's passages, minus those of the question) appear in the reply; with
  no evidence words, any non-refusal counts. Tasks named `*_refused_*` must decline: a refusal cue and
  no 5-word span copied from the passages. Cannot judge: whether a refusal is *well argued*, whether
  the role's knowledge boundary is explained in character, paraphrased answers sharing no words.
- role_style: format facts of the role-play: narration (bracketed or *starred* actions) present in
  `*_with_narration` tasks and absent from `*_no_narration` ones; no speaking for another role
  ("User: ..."); not empty. Cannot judge: voice, tone, personality, catchphrases.
- nested: every formatting rule stated in the system prompt (its `Formatting rule:` lines, else all of
  it), parsed from its wording and checked exactly by eval's own verifier (rolemrc.eval.rule_parse:
  emojis, keywords, endings, punctuation, capitals, word limits, language). A broken rule scores 0;
  otherwise a rule clause it does not fully understand, or a check it cannot decide (the language of
  a reply too short to tell), gives no score (status `unjudgeable`, counted, with the reason).
  Cannot judge: free-form content constraints ("mention your childhood"); in a system prompt without
  rule lines, a clause stating no recognised rule reads as the role's description.
- multi_turn: answerable (`-2ndanswer`) must answer after the user insists, unanswerable
  (`-2ndrefused`) must keep refusing; both with the knowledge checks above.
- prioritized (`-refused`): the system directive forbids answering, so the reply must decline
  (refusal check above). Cannot judge: whether the directive was *cited*.

A damaged reply (rolemrc.eval.damage: empty, degenerate, in the wrong language) never reaches these verifiers:
`eval.judges.judge` fails it on every aspect first.
"""

from __future__ import annotations

import re
from typing import Any

from rolemrc.core.records import prompt_turns
from rolemrc.core.taxonomy import Aspect, split_task
from rolemrc.core.text import ACTION_SPAN, NARRATION_MARK, content_words, words
from rolemrc.eval.rule_parse import find_rule, nested_verdict
from rolemrc.eval.verdicts import UNJUDGEABLE, Verdict

REFUSAL = re.compile("|".join((
    r"\b(?:can ?not|can't|won't|will not|unable to|not able to|shouldn't|must not|may not)\b[^.!?]{0,40}?"
    r"\b(?:answer|say|help|tell|guess|make|invent|give|share|discuss|comment|respond|provide|assist)",
    r"\bnot (?:allowed|permitted|supposed)\b", r"\bnot to (?:answer|say|discuss|share|respond)\b",
    r"\b(?:rather not|decline|refuse)\b", r"\bno business\b",
    r"\bleave (?:that|this|it)(?: one)? alone\b", r"\b(?:far )?(?:outside|beyond) (?:what i|my)\b",
    r"\bnot an expert\b", r"\bask someone\b",
    r"\b(?:does not|doesn't|do not|don't|did not|didn't|never) (?:say|mention|answer|tell|contain|state|cover)s?\b",
    r"\bnot (?:there|in (?:the|these|this) (?:text|passages?))\b", r"\bnothing in\b", r"\bno (?:idea|answer)\b",
    r"\b(?:don't|do not) know\b", r"\bi(?:'m| am) (?:sorry|afraid)\b", r"\bwould be (?:dishonest|guessing)\b",
)), re.I)
ROLE_PREFIX = re.compile(r"^\s*(?:user|assistant|system)\s*:", re.I | re.M)
QUESTION_LINE = re.compile(r"^\s*question\s*:\s*(.+)$", re.I | re.M)

__all__ = ["find_rule", "judge_item"]


def copies_passage(reply: str, passages: str, n: int = 5) -> bool:
    """Whether the reply repeats n consecutive words of the passages."""
    passage_words = words(passages)
    grams = {tuple(passage_words[i:i + n]) for i in range(len(passage_words) - n + 1)}
    said = words(reply)
    return any(tuple(said[i:i + n]) in grams for i in range(len(said) - n + 1))


class ItemView:
    """The parts of a test item the verifiers look at."""

    def __init__(self, item: dict[str, Any]):
        turns = prompt_turns(item, where=f"item {item.get('id')!r}")
        self.system = "\n".join(t["content"] for t in turns if t["role"] == "system")
        self.user = "\n".join(t["content"] for t in turns if t["role"] == "user")
        self.request = next((t["content"] for t in reversed(turns) if t["role"] == "user"), "")
        self.reference = str(item.get("reference") or "")
        questions = QUESTION_LINE.findall(self.user)
        excluded = set(content_words(" ".join(questions))) | set(content_words(self.system))
        self.evidence = (set(content_words(self.reference)) & set(content_words(self.user))) - excluded

    def answers(self, reply: str) -> tuple[bool, str]:
        if self.evidence:
            found = self.evidence & set(content_words(reply))
            need = max(1, (len(self.evidence) + 1) // 2)
            return len(found) >= need, f"{len(found)}/{len(self.evidence)} evidence words (need {need})"
        refused = bool(REFUSAL.search(reply))
        cue = "refusal cue" if refused else "no refusal cue"
        return bool(reply.strip()) and not refused, f"no evidence words; {cue}"

    def refuses(self, reply: str) -> tuple[bool, str]:
        cue = REFUSAL.search(reply)
        if not cue:
            return False, "no refusal cue"
        if copies_passage(reply, self.user):
            return False, f"refusal cue {cue.group(0)!r} but copies the passage"
        return True, f"refusal cue {cue.group(0)!r}"


def must_answer(task: str, aspect: Aspect) -> bool:
    base, variant = split_task(task)
    if variant == "refused" or aspect.detail == "unanswerable":
        return False
    if aspect.detail == "answerable":
        return True
    return "_answer_" in base


def style(task: str, reply: str) -> tuple[bool, str]:
    if not reply.strip():
        return False, "empty reply"
    if ROLE_PREFIX.search(reply):
        return False, "speaks for another role"
    if split_task(task)[0].endswith("_with_narration"):
        return (True, "narration present") if ACTION_SPAN.search(reply) else (False, "no narration")
    return (False, "narration where none is allowed") if NARRATION_MARK.search(reply) else (True, "speech only")


def judge_item(item: dict[str, Any], aspect: Aspect) -> Verdict:
    """The rules judge's verdict on one (item with `response`, aspect)."""
    reply = str(item.get("response") or "")
    task = item["task"]
    view = ItemView(item)
    if aspect.dimension == "role_style":
        ok, why = style(task, reply)
    elif aspect.dimension == "nested":
        score, why = nested_verdict(view.system, reply.strip(), view.request)
        if score is None:
            return Verdict.make(item["id"], task, aspect, None, UNJUDGEABLE, why)
        ok = bool(score)
    else:
        ok, why = view.answers(reply) if must_answer(task, aspect) else view.refuses(reply)
        why = ("answer expected: " if must_answer(task, aspect) else "refusal expected: ") + why
    return Verdict.make(item["id"], task, aspect, int(ok), reason=why)
