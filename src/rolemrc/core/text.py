"""The text rules that datagen writes by and the rules judge checks by: narration marks and spans, words, content words.

Narration is written in brackets or stars: "(smiles)", "[nods]", "*sighs*". Two span rules, each conservative for
its user: the generator removes every bracketed span, however short, before asking what a reply *said*
(`NARRATED_SPAN`); the judge credits narration only for a span of two or more characters (`ACTION_SPAN`), so "()"
or a footnote mark "[1]" is no action."""

from __future__ import annotations

import re

NARRATION_MARK = re.compile(r"[()\[\]*]")                                      # a speech-only reply holds none
NARRATED_SPAN = re.compile(r"\([^()]*\)|\[[^\[\]]*\]|\*[^*]*\*")               # what is narrated, not said
ACTION_SPAN = re.compile(r"\([^()]{2,}\)|\[[^\[\]]{2,}\]|\*[^*]{2,}\*")        # narration the judge credits
STOP_WORDS = frozenset(("a", "an", "the", "of", "in", "on", "at", "to", "and", "or", "is", "are", "was", "were", "be",
                        "by", "for", "with", "from", "as", "that", "this", "it", "its", "about", "around", "into",
                        "over", "than", "some"))


def words(text: str) -> list[str]:
    """Lower-cased runs of letters and digits."""
    return re.findall(r"[a-z0-9]+", text.lower())


def content_words(text: str) -> list[str]:
    """`words` minus STOP_WORDS (what the evidence and answer checks compare)."""
    return [w for w in words(text) if w not in STOP_WORDS]
