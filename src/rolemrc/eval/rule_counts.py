"""Nested rules on how often something occurs, with IFEval's counting (lm-eval's checkers are the reference):

- frequency: a keyword appears N times (any case, inside longer words too: its occurrences as a substring)
- letters: a letter appears N times (any case)
- sentences: the reply has N sentences (as Punkt splits them; where a split is a maybe and decides the count,
  CannotTell)
- capital_words: N words in capitals (as str.isupper and a Treebank tokenizer see them; likewise)

Each takes a relation: less than, at least, at most, no more than, more than, exactly N.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from rolemrc.eval.rule_registry import QUOTED, RELATION, WORD, bounds, counted, outside, rule_kind, shown
from rolemrc.eval.text_facts import CannotTell, capital_word_range, sentence_range

USE = r"(?:use|mention|include|say|repeat|write)\w*"
APPEAR = r"(?:should|must|has\s+to|needs?\s+to|is\s+to)\s+(?:appear|occur|be\s+used)"


def _with(name: str) -> Callable[[dict[str, str | None]], dict[str, Any] | None]:
    """Params of bounds plus the quoted or bare word as `name`."""
    def params(g: dict[str, str | None]) -> dict[str, Any] | None:
        found = bounds(g)
        return None if found is None else {**found, name: g.get("quoted") or g.get("bare")}
    return params


def decided(low: int, high: int, params: dict[str, Any], what: str) -> str | None:
    """The verdict on a count known to lie in low..high: CannotTell where the ends disagree."""
    broken = outside(low, params), outside(high, params)
    if broken[0] != broken[1]:
        raise CannotTell(f"{low}..{high} {what} (where the text splits is unsure), {shown(params)}")
    return f"{low} {what}, {shown(params)}" if broken[0] else None


@rule_kind(
    "frequency",
    rf"\bthe\s+(?:key)?(?:word|term|phrase)\s+{WORD}\s+{APPEAR}\s+{RELATION}\s+times\b",
    rf"\b{USE}\s+(?:the\s+)?(?:key)?(?:word|term|phrase)\s+{WORD}\s+{RELATION}\s+times\b",
    rf"\b{USE}\s+{QUOTED}\s+{RELATION}\s+times\b",
    params=_with("word"))
def frequency(params: dict[str, Any], text: str) -> str | None:
    return counted(len(re.findall(re.escape(params["word"]), text, re.I)), params, f"times {params['word']!r}")


LETTER = r"(?:['\"‘“](?P<quoted>[a-z])['\"’”]|(?P<bare>[a-z])\b)"


@rule_kind(
    "letters",
    rf"\bthe\s+letter\s+{LETTER}\s+{APPEAR}\s+{RELATION}\s+times\b",
    rf"\b(?:use|include|write)\w*\s+the\s+letter\s+{LETTER}\s+{RELATION}\s+times\b",
    params=_with("letter"))
def letters(params: dict[str, Any], text: str) -> str | None:
    return counted(text.lower().count(params["letter"].lower()), params, f"times {params['letter']!r}")


@rule_kind("sentences", rf"\b{RELATION}\s+sentences\b", params=bounds)
def sentences(params: dict[str, Any], text: str) -> str | None:
    return decided(*sentence_range(text), params, "sentences")


CAPITAL_WORDS = r"(?:(?:all[\s-])?(?:capitali[sz]ed|upper[\s-]?case|capital)\s+words|all[\s-]caps\s+words)"


@rule_kind(
    "capital_words",
    rf"\bwords\s+(?:with|in|written\s+in)\s+all\s+(?:capital\s+letters|caps|upper[\s-]?case)\s+{APPEAR}\s+{RELATION}"
    r"\s+times\b",
    rf"\b{RELATION}\s+{CAPITAL_WORDS}\b",
    rf"\b{RELATION}\s+words\s+(?:with|in|written\s+in)\s+all\s+(?:capital\s+letters|caps|upper[\s-]?case)\b",
    params=bounds)
def capital_words(params: dict[str, Any], text: str) -> str | None:
    return decided(*capital_word_range(text), params, "words in capitals")
