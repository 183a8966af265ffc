"""What a reply must do (ReplySpec), the nested formatting rules, and reply validation.

Both backends answer a ReplySpec; every reply, template or LLM, passes `check_reply` before it is
used, so malformed LLM output is caught the same way everywhere.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rolemrc.core.text import NARRATED_SPAN, NARRATION_MARK, content_words

# intent -> what the role must do (also the instruction an LLM backend receives).
INTENTS: dict[str, str] = {
    "answer": "Answer the question from the passage, in character and in your own voice.",
    "refuse_unanswerable": "The passage does not contain the answer. Say so in character and do not guess.",
    "refuse_outside": "The question lies outside your character's knowledge. Decline in character without answering.",
    "answer_outside": "The question lies outside your character's knowledge, but answer it from the passage, "
                      "noting in character that it is not your field.",
    "refuse_directive": "A global rule from the system forbids answering. Decline in character without answering.",
    "insist_answer": "The user insists. Give in and answer the question from the passage, in character.",
    "insist_refuse": "The user insists, but the passage still does not contain the answer. Refuse again, in character.",
    "chat": "Reply in character to the user's last message, drawing on your profile.",
    "greet": "Open the conversation in character with a greeting.",
    "scene": "React in character to the text in the scene, summarising what it is about.",
}
ANSWERING = frozenset({"answer", "answer_outside", "insist_answer"})
REFUSING = frozenset({"refuse_unanswerable", "refuse_outside", "refuse_directive", "insist_refuse"})
# a refusal says no somehow; one without any of these words gives something else (often an invented answer)
DECLINING = re.compile(r"\b(not|no|never|nothing|nowhere|cannot|unable|sorry|decline|refuse|outside|afraid|rather)\b|n['’]t\b",
                       flags=re.I)
MAX_REPLY_WORDS = 250
# the openai backend's instructions (and the profile's first line): a reply that quotes them leaks the prompt
PROMPT_PHRASES = ("stay in character as described below", "task for your next reply", "describe at least one action",
                  "speak only; no narration", "formatting rule you must obey", "write only the reply itself")
REPEATS = 2              # a sentence (of 3+ words) said this often
MIN_DISTINCT_TRIGRAMS = 0.5   # share of distinct word trigrams in a reply of 30+ words


def repeats_itself(text: str) -> bool:
    """A sentence said REPEATS times, or a long reply made of few distinct word trigrams (degenerate loops)."""
    sentences = [" ".join(s.lower().split()) for s in re.split(r"(?<=[.!?])\s+|\n+", text)]
    counts = Counter(s for s in sentences if len(s.split()) >= 3)
    if counts and max(counts.values()) >= REPEATS:
        return True
    words = text.lower().split()
    trigrams = list(zip(words, words[1:], words[2:]))
    return len(words) >= 30 and len(set(trigrams)) < MIN_DISTINCT_TRIGRAMS * len(trigrams)


EMOJI = re.compile("[\U0001F300-\U0001FAFF\u2600-\u27BF]")


@dataclass(frozen=True)
class Rule:
    """A nested formatting rule: its kind, the instruction given to the role, and its parameter."""

    kind: str          # emoji_start | keyword | signoff | upper | lower | max_words | no_commas
    instruction: str
    value: str | int | None = None

    @property
    def category(self) -> str:
        """special-content or special-format (the RoleMRC task suffix)."""
        return "special-content" if self.kind in ("emoji_start", "keyword", "signoff") else "special-format"


@dataclass(frozen=True)
class ReplySpec:
    """One assistant turn to write: who speaks, what they must do, with which material."""

    profile: dict[str, Any]
    intent: str
    narration: bool
    history: tuple[dict[str, str], ...] = ()
    passages: tuple[str, ...] = ()
    question: str | None = None
    answer: str | None = None
    topic: str | None = None
    rule: Rule | None = None
    key: str = ""                      # stable id of this turn (seeds the template backend)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.intent not in INTENTS:
            raise ValueError(f"unknown intent {self.intent!r}")
        if self.intent in ANSWERING and not self.answer:
            raise ValueError(f"intent {self.intent!r} needs an answer")


def said(words: set[str], spoken: str) -> int:
    """How many of `words` the spoken text holds."""
    return len(words & set(content_words(spoken)))


def check_rule(rule: Rule, text: str) -> str | None:
    """None if `text` obeys the rule, else the reason."""
    words = text.split()
    ok = {
        "emoji_start": lambda: bool(EMOJI.match(text)),
        "keyword": lambda: str(rule.value).lower() in text.lower(),
        "signoff": lambda: text.rstrip().endswith(str(rule.value)),
        "upper": lambda: not any(c.islower() for c in text),
        "lower": lambda: not any(c.isupper() for c in text),
        "max_words": lambda: len(words) <= int(rule.value),
        "no_commas": lambda: "," not in text,
    }[rule.kind]()
    return None if ok else f"breaks rule {rule.kind}"


def check_reply(spec: ReplySpec, text: Any) -> str | None:
    """None if the reply is usable for `spec`, else a short reason (counted when it is dropped)."""
    if not isinstance(text, str) or not text.strip():
        return "empty reply"
    words = text.split()
    if len(words) > MAX_REPLY_WORDS:
        return "reply too long"
    if re.search(r"^\s*(user|assistant|system)\s*:", text, flags=re.I | re.M):
        return "speaks for another role"
    if repeats_itself(text):
        return "repeats itself"
    if any(phrase in " ".join(text.lower().split()) for phrase in PROMPT_PHRASES):
        return "echoes the instructions"
    if not spec.narration and NARRATION_MARK.search(text):
        return "narration where none is allowed"
    if spec.narration and not NARRATION_MARK.search(text) and not (spec.rule and spec.rule.kind == "max_words"):
        return "narration missing"      # under a word limit narration is optional (the template drops it)
    spoken = NARRATED_SPAN.sub(" ", text)     # the answer and the refusal must be said, not narrated
    answer = set(content_words(spec.answer or ""))
    if spec.intent in ANSWERING and answer and said(answer, spoken) < max(1, len(answer) // 2):
        return "answer missing"
    if spec.intent in REFUSING:
        if not DECLINING.search(spoken):
            return "refusal missing"
        # most of the answer's own words (not the question's or the topic's, which a refusal may name)
        own = answer - set(content_words(f"{spec.question or ''} {spec.topic or ''}"))
        if own and said(own, spoken) > len(own) / 2:
            return "answers when it should decline"
    if spec.rule is not None:
        return check_rule(spec.rule, text)
    return None
