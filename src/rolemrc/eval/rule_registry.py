"""The registry of nested rule kinds and the wording they share: each kind registers its phrasings (regexes whose
named groups carry the parameters) and one checker. rule_parse reads the registry; the kinds live in rule_parse
(emojis, keywords, endings, punctuation, capitals, words, language), rule_counts (how often something occurs) and
rule_layout (the reply's shape: paragraphs, sections, lists, markup, wrappers)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rolemrc.eval.text_facts import NUMBER, parse_number


@dataclass(frozen=True)
class Rule:
    """One recognised rule: its kind, its parameters and the words it was read from."""

    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    source_text: str = ""


Params = Callable[[dict[str, str | None]], "dict[str, Any] | None"]
Checker = Callable[[dict[str, Any], str], "str | None"]
PHRASINGS: list[tuple[str, re.Pattern[str], Params]] = []
CHECKS: dict[str, Checker] = {}
REQUEST = "request"   # the parameter every checker also gets: the user's request the reply answers ("" if unknown)


def rule_kind(name: str, *patterns: str, params: Params = lambda g: {}) -> Callable[[Checker], Checker]:
    """Register a rule kind: its phrasings (regexes), how a match's named groups become its parameters
    (None: not a rule after all), and the decorated checker: (params, stripped reply) -> None if obeyed,
    else why not."""
    assert name not in CHECKS, f"rule kind {name!r} registered twice"

    def register(check: Checker) -> Checker:
        PHRASINGS.extend((name, re.compile(p, re.I | re.M), params) for p in patterns)
        CHECKS[name] = check
        return check
    return register


NOT = (r"\b(?:(?:do|does|must|should|may|will)\s+not|don't|doesn't|mustn't|shouldn't|cannot|can't|never|avoid|"
       r"without|refrain\s+from)")
QUOTED = r"['\"‘“](?P<quoted>.+?)['\"’”](?=[\s.,;:!?)]*(?:$|\s))"
WORD = rf"(?:{QUOTED}|(?P<bare>[\w'-]+))"   # a quoted phrase or a bare word
NOT_MORE = rf"(?:{NOT}\s+(?:(?:us|includ|add|writ|put)\w*\s+)?|\b(?:no|not)\s+)more\s+than"
END = r"\b(?:(?:end|finish|conclude|close|sign\s+off)(?:s|ing)?|wrap(?:s|ping)?\s+up)\b"
# "less than 3", "at least three", "no more than 5", "exactly 2": a relation and its number (groups rel_*, n)
RELATION = (rf"(?:(?P<rel_lt>(?:less|fewer)\s+than|under|below)|(?P<rel_ge>at\s+least|(?:no|not)\s+(?:less|fewer)\s+than|"
            rf"a\s+minimum\s+of)|(?P<rel_le>at\s+most|{NOT_MORE}|up\s+to|a\s+maximum\s+of)|(?P<rel_gt>more\s+than)|"
            rf"(?P<rel_eq>exactly|precisely))\s+(?P<n>{NUMBER})")


def bounds(g: dict[str, str | None]) -> dict[str, int] | None:
    """{"min": .., "max": ..} (either may be missing) from a RELATION match; None if its number is not one."""
    if (n := parse_number(g.get("n") or "")) is None:
        return None
    offsets = {"rel_lt": {"max": n - 1}, "rel_ge": {"min": n}, "rel_le": {"max": n}, "rel_gt": {"min": n + 1},
               "rel_eq": {"min": n, "max": n}}
    return next((bound for name, bound in offsets.items() if g.get(name) is not None), None)


def outside(n: int, params: dict[str, Any]) -> bool:
    """Whether a count breaks the params' bounds."""
    return n < params.get("min", n) or n > params.get("max", n)


def shown(params: dict[str, Any]) -> str:
    """The params' bounds in words."""
    return f"allowed {params.get('min', 0)}..{params.get('max', 'any')}"


def counted(n: int, params: dict[str, Any], what: str) -> str | None:
    """None if a count of `what` keeps the params' bounds, else why not."""
    return f"{n} {what}, {shown(params)}" if outside(n, params) else None
