"""Damaged replies: empty, degenerate or in the wrong language.

A damaged reply is no reply to judge: `eval.judges.judge` fails it on every aspect before any judge (rules, openai or
a registered one) is asked, with the damage as the reason, and the judge aggregates count it on its own (`damaged`).
The rules, none of which fires on datagen's template replies and references or on the bundled passages:

- empty: no letter or digit (blank, only punctuation, only emojis), or not one word outside stage directions
  (`core.text.ACTION_SPAN`: "(smiles)", "*nods* (laughs)"; one cut off at the end by the token limit counts as one):
  a reply that acts and says nothing answers nothing. DPO steps on narration pairs left SmolLM2 answering a quarter
  to over half of its prompts with a bare "(smiles)", or with "(laughs) (smiles) (chuckles)".
- degenerate: a loop, some stretch of p words said again right after itself until a word trigram has come three
  times (p + 3 words in a row, each equal to the word p later): "is is is is is" (one word five times in a row),
  "ha ho ha ho ha ho ha", "the tide turns the tide turns the tide turns"; a trigram said twice, or three times
  apart ("one of the" in a long answer), is no loop. Words are runs of letters and digits, lower-cased ("don't" and
  "0.5" are one word; so is a run of Chinese or Japanese characters, so a loop inside unspaced text is not seen).
  Also degenerate: a reply of MIN_VISIBLE or more visible characters, more than half of them punctuation or symbols
  (emojis aside).
- wrong_language: a reply of MIN_LANGUAGE_WORDS or more words (`text_facts.count_words`) that reads as neither the
  language its prompt is written in nor a language a rule of its system prompt asks for (`rule_parse`), each told
  by `text_facts.language_problem`. A reply that might still be one of them (too little to tell) and a prompt whose
  language cannot be told are never wrong; so a reply in the prompt's language is never damage even where a rule
  asks for another (the nested verdict judges that).
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rolemrc.core.records import prompt_turns
from rolemrc.core.taxonomy import Aspect
from rolemrc.core.text import ACTION_SPAN
from rolemrc.eval.rule_parse import find_rules
from rolemrc.eval.text_facts import EMOJI, LANGUAGES, CannotTell, count_words, language_problem
from rolemrc.eval.verdicts import Verdict

KINDS = ("empty", "degenerate", "wrong_language")
WORD = re.compile(r"[^\W_]+(?:['’.,][^\W_]+)*")
MIN_VISIBLE = 20             # visible characters before the share of punctuation and symbols counts
MAX_SYMBOL_SHARE = 0.5
MIN_LANGUAGE_WORDS = 10      # a shorter reply is never in the wrong language
UNCLOSED_ACTION = re.compile(r"[(\[*][^()\[\]*]*$")   # a stage direction cut off by the token limit


@dataclass(frozen=True)
class Damage:
    """Why a reply is damaged: its kind (one of KINDS) and what was found."""

    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} ({self.detail})"


def loop(words: list[str]) -> tuple[int, int] | None:
    """(start, period) of the first loop in `words`: period + 3 words in a row, each equal to the word `period`
    later, so the trigram at start comes back at start + period and start + 2 * period; None without one."""
    if max(Counter(zip(words, words[1:], words[2:])).values(), default=0) < 3:
        return None   # a loop says a trigram three times; without one the quadratic scan below is skipped
    for period in range(1, (len(words) - 1) // 2):
        run = 0
        for j in range(len(words) - period):
            run = run + 1 if words[j] == words[j + period] else 0
            if run == period + 3:
                return j + 1 - run, period
    return None


def symbol_share(reply: str) -> tuple[int, float]:
    """(visible characters, the share of them that are punctuation or symbols), emojis aside."""
    visible = [c for c in EMOJI.sub("", reply) if not c.isspace()]
    symbols = sum(unicodedata.category(c)[0] in "PS" for c in visible)
    return len(visible), symbols / len(visible) if visible else 0.0


def text_language(text: str) -> str | None:
    """The one of LANGUAGES that `text` reads as, if it can be told."""
    for language in LANGUAGES:
        try:
            if language_problem(text, language) is None:
                return language
        except CannotTell:
            continue
    return None


def allowed_languages(prompt: str, system: str) -> Iterator[tuple[str, str]]:
    """(language, whose) a reply may be written in: the prompt's, if told, then any a rule of the system prompt asks
    for (parsed only when asked for)."""
    if (language := text_language(prompt)) is None:
        return
    yield language, "the prompt's"
    for rule in find_rules(system):
        if rule.kind == "language" and rule.params["language"] != language:
            yield rule.params["language"], "asked by a rule"


def wrong_language(reply: str, prompt: str, system: str) -> str | None:
    """Why the reply reads as none of its allowed languages, or None (also when that cannot be told)."""
    problems = []
    for language, whose in allowed_languages(prompt, system):
        try:
            problem = language_problem(reply, language)
        except CannotTell:
            return None
        if problem is None:
            return None
        problems.append(f"not {language} ({whose}): {problem}")
    return "; ".join(problems) or None


def damage(reply: str, prompt: str = "", system: str = "") -> Damage | None:
    """How `reply` is damaged, or None. `prompt`: the text of the turns it answers (its language is the case's);
    `system`: the system prompt, whose rules may ask for another language."""
    if not any(c.isalnum() for c in reply):
        return Damage("empty", "no letter or digit")
    words = WORD.findall(reply.lower())
    if found := loop(words):
        start, period = found
        return Damage("degenerate", f"loops on {' '.join(words[start:start + period])!r} from word {start + 1}")
    closed_out = ACTION_SPAN.sub(" ", reply)
    actions = len(ACTION_SPAN.findall(reply)) + bool(UNCLOSED_ACTION.search(closed_out))
    if actions and not WORD.search(UNCLOSED_ACTION.sub(" ", closed_out)):
        return Damage("empty", f"{actions} stage direction{'s' * (actions > 1)} and not a word said")
    visible, share = symbol_share(reply)
    if visible >= MIN_VISIBLE and share > MAX_SYMBOL_SHARE:
        return Damage("degenerate", f"{share:.0%} of {visible} visible characters are punctuation or symbols")
    if count_words(reply) < MIN_LANGUAGE_WORDS:
        return None   # too short to be in the wrong language
    why = wrong_language(reply, prompt, system)
    return Damage("wrong_language", why) if why else None


def item_damage(item: dict[str, Any]) -> Damage | None:
    """`damage` of a test item's `response`, against its prompt turns."""
    turns = prompt_turns(item, where=f"item {item.get('id')!r}")
    system = "\n".join(t["content"] for t in turns if t["role"] == "system")
    return damage(str(item.get("response") or ""), "\n".join(t["content"] for t in turns), system)


def damaged_verdict(item: dict[str, Any], aspect: Aspect, found: Damage) -> Verdict:
    """The verdict every aspect of a damaged reply gets, whichever the judge: 0, the damage as the reason."""
    return Verdict.make(item["id"], item["task"], aspect, 0, reason=f"damaged reply: {found}", damage=found.kind)
