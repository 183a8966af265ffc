"""Nested formatting rules: parsed from the system prompt's wording, each checked exactly on the reply.

This is eval's own verifier: it never imports the datagen package, so a bug in the generator's rules shows
up here instead of being graded by itself, and rules phrased in other ways (the RoleMRC release's) are
judged too. Each rule kind registers its phrasings (regexes whose named groups carry the parameters)
and one checker. Where phrasings overlap, the longest match wins, so "Do not use any capital letters"
is `lower`, not `upper`. The kinds and what they check:

- emoji: begins / ends with an emoji; at least N, exactly N, at most N or no emojis
- keyword: the word appears (any case, inflections count) / must not appear as a word
- ends_with: ends with the given phrase (case-sensitive) or punctuation mark
- forbidden_mark: no commas / exclamation marks / question marks / semicolons / colons / periods
- upper / lower / title: no lower-case letters / no capitals / every word starts with a capital
- words: at most, fewer than, at least, more than, exactly or between N words (digits or words)
- language: written in the language (text_facts.language_problem says how that is told)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rolemrc.eval.text_facts import (
    LANGUAGES,
    NUMBER,
    count_words,
    emojis,
    ends_with_emoji,
    language_problem,
    parse_number,
    starts_with_emoji,
)


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


def rule_kind(name: str, *patterns: str, params: Params = lambda g: {}) -> Callable[[Checker], Checker]:
    """Register a rule kind: its phrasings (regexes), how a match's named groups become its parameters
    (None: not a rule after all), and the decorated checker: (params, stripped reply) -> None if obeyed,
    else why not."""
    def register(check: Checker) -> Checker:
        PHRASINGS.extend((name, re.compile(p, re.I | re.M), params) for p in patterns)
        CHECKS[name] = check
        return check
    return register


NOT = (r"\b(?:(?:do|does|must|should|may|will)\s+not|don't|doesn't|mustn't|shouldn't|cannot|can't|never|avoid|"
       r"without|refrain\s+from)")
QUOTED = r"['\"‘“](?P<quoted>.+?)['\"’”](?=[\s.,;:!?)]*(?:$|\s))"
END = r"\b(?:end|finish|conclude|close|sign\s+off)(?:s|ing)?\b"


def _count(text: str | None) -> int | None:
    """An emoji count as stated; "an", "some", "one or more" or none stated mean at least one."""
    vague = text is None or " ".join(text.lower().split()) in ("a", "an", "some", "one or more")
    return 1 if vague else parse_number(text)


def _emoji_params(g: dict[str, str | None]) -> dict[str, Any] | None:
    if g.get("start") is not None or g.get("end") is not None:
        return {"at": "start" if g.get("start") is not None else "end", "negated": g.get("negated") is not None}
    if g.get("none") is not None:
        return {"max": 0}
    if g.get("most") is not None:
        return None if (n := _count(g["most"])) is None else {"max": n}
    n = _count(g.get("n"))
    return None if n is None else {"min": n, **({"max": n} if g.get("exactly") else {})}


@rule_kind(
    "emoji",
    rf"(?:(?P<negated>{NOT})\s+)?\b(?:begin|start|open)\w*\b[^.\n]{{0,40}}?\bwith\s+(?:an?|one|a\s+single|any)\s+emojis?\b"
    r"(?P<start>)",
    r"\bemoji\s+(?:at|as)\s+the\s+(?:very\s+)?(?:start|beginning|first\s+character)\b(?P<start>)",
    rf"(?:(?P<negated>{NOT})\s+)?{END}[^.\n]{{0,40}}?\bwith\s+(?:an?|one|a\s+single|any)\s+emojis?\b(?P<end>)",
    r"\bemoji\s+(?:at|as)\s+the\s+(?:very\s+)?(?:end|last\s+character)\b(?P<end>)",
    rf"{NOT}\s+(?:(?:us|includ|add|insert|put)\w*\s+)?(?:any\s+)?emojis?\b(?P<none>)",
    r"\bno\s+emojis?\b(?P<none>)", r"\bemoji-free\b(?P<none>)",
    rf"\b(?:at\s+most|(?:no|not)\s+more\s+than|up\s+to)\s+(?P<most>{NUMBER})\s+emojis?\b",
    rf"\b(?:include|use|add|insert|put|contain|incorporate)\w*\s+(?:(?P<exactly>exactly)\s+|at\s+least\s+)?"
    rf"(?P<n>{NUMBER}|an?|some|one\s+or\s+more)\s+emojis?\b",
    r"\b(?:include|use|add)\w*\s+emojis\b",
    params=_emoji_params)
def emoji(params: dict[str, Any], text: str) -> str | None:
    if "at" in params:
        at, negated = params["at"], params.get("negated", False)
        found = (starts_with_emoji if at == "start" else ends_with_emoji)(text)
        if found != negated:
            return None
        verb = "begin" if at == "start" else "end"
        return f"{verb}s with an emoji" if negated else f"does not {verb} with an emoji"
    n = len(emojis(text))
    if n < params.get("min", 0) or n > params.get("max", n):
        return f"{n} emojis"
    return None


WORD = rf"(?:{QUOTED}|(?P<bare>[\w'-]+))"
NAMED = r"(?:the\s+)?(?:exact\s+)?(?:word|phrase|term|keyword|expression)"


@rule_kind(
    "keyword",
    rf"\b(?:use|include|mention|say|contain|incorporate|feature)\w*\s+{NAMED}\s+{WORD}",
    rf"\bthe\s+(?:word|phrase|term|keyword)\s+{WORD}\s+(?:must|should|has\s+to)\s+(?:appear|be\s+(?:used|included))",
    rf"{NOT}\s+(?:(?:us|includ|mention|say|writ|contain)\w*\s+)?{NAMED}\s+{WORD}(?P<forbidden>)",
    rf"\bthe\s+(?:word|phrase|term)\s+{WORD}\s+(?:(?:must|should)\s+not\s+appear|is\s+(?:forbidden|not\s+allowed))"
    r"(?P<forbidden>)",
    params=lambda g: {"word": g["quoted"] or g["bare"], "forbidden": g.get("forbidden") is not None})
def keyword(params: dict[str, Any], text: str) -> str | None:
    word = params["word"]
    if params["forbidden"]:
        return f"uses {word!r}" if re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text, re.I) else None
    return None if word.lower() in text.lower() else f"no {word!r}"


MARKS = {"question": "?", "exclamation": "!", "period": ".", "full": "."}


@rule_kind(
    "ends_with",
    rf"{END}[^.\n:]{{0,40}}?\bwith\s+(?:an?\s+|the\s+|one\s+)?(?P<mark>question\s+mark|exclamation\s+(?:mark|point)|"
    r"period|full\s+stop)\b",
    rf"{END}[^.\n:'\"‘“]{{0,40}}?\bwith\s+(?:the\s+)?(?:(?:exact|following|same)\s+)*(?:(?:sentence|phrase|words?|line|"
    rf"sign-?off)\s*:?\s*)?{QUOTED}",
    rf"{END}[^.\n:'\"‘“]{{0,40}}?\bwith\s+(?:the\s+)?(?:(?:exact|following|same)\s+)*(?:sentence|phrase|words?|line|"
    r"sign-?off)\s*:?\s*(?P<rest>[^'\"‘“\s].*?)\s*$",
    params=lambda g: ({"text": MARKS[g["mark"].split()[0].lower()], "mark": True} if g.get("mark")
                      else {"text": g.get("quoted") or g["rest"], "mark": False}))
def ends_with(params: dict[str, Any], text: str) -> str | None:
    """A mark may be followed by closing quotes or brackets; a phrase ending in a letter by a full stop."""
    end, tail = params["text"], text.rstrip()
    if params["mark"]:
        tail = tail.rstrip("\"'”’»)]")
    elif end[-1:].isalnum():
        tail = tail.rstrip(".!?")
    return None if tail.endswith(end) else f"does not end with {end!r}"


MARK_CHARS = {"comma": ",，、،", "exclamation": "!！", "question": "?？", "semicolon": ";；", "colon": ":：",
              "period": ".。", "full": ".。"}
MARK_NAME = (r"(?P<mark>commas?|exclamation\s+(?:marks?|points?)|question\s+marks?|semicolons?|colons?|periods|"
             r"full\s+stops)")


@rule_kind(
    "forbidden_mark",
    rf"{NOT}\s+(?:(?:us|includ|put|add|writ|contain)\w*\s+)?(?:any\s+|a\s+single\s+|an?\s+)?{MARK_NAME}\b",
    rf"\bno\s+{MARK_NAME}\b", rf"\b{MARK_NAME}\s+(?:are|is)\s+not\s+(?:allowed|permitted)\b",
    r"\b(?P<mark>comma)-free\b",
    params=lambda g: {"mark": g["mark"].split()[0].lower().rstrip("s")})
def forbidden_mark(params: dict[str, Any], text: str) -> str | None:
    found = sum(text.count(c) for c in MARK_CHARS[params["mark"]])
    return f"{found} {params['mark']} mark(s)" if found else None


CAPITALS = r"(?:capital|upper[\s-]?case)\s+letters"


@rule_kind("upper", rf"\b(?:{CAPITALS}|uppercase|upper\s+case|all[\s-]caps|block\s+capitals|in\s+capitals)\b",
           rf"{NOT}\s+(?:(?:us|includ|writ)\w*\s+)?(?:any\s+)?lower[\s-]?case(?:\s+letters)?\b",
           r"\bcapitali[sz]e\s+(?:all|every)\s+letters?\b")
def upper(params: dict[str, Any], text: str) -> str | None:
    return "has lower-case letters" if any(c.islower() for c in text) else None


@rule_kind("lower", r"\blower[\s-]?case\b", rf"{NOT}\s+(?:(?:us|includ|writ)\w*\s+)?(?:any\s+)?{CAPITALS}\b",
           rf"\bno\s+{CAPITALS}\b", r"\bno\s+capitali[sz]ation\b", rf"{NOT}\s+capitali[sz]e\b")
def lower(params: dict[str, Any], text: str) -> str | None:
    return "has capital letters" if any(c.isupper() for c in text) else None


@rule_kind("title", r"\bcapitali[sz]e\s+(?:the\s+first\s+letter\s+of\s+)?(?:every|each|all(?:\s+the)?)\s+words?\b",
           r"\b(?:start|begin)\w*\s+(?:every|each)\s+word\s+with\s+(?:a\s+)?(?:capital|upper[\s-]?case)(?:\s+letters?)?",
           r"\b(?:every|each)\s+word\b[^.\n]{0,30}?\b(?:start|begin)\w*\s+with\s+(?:a\s+)?(?:capital|upper[\s-]?case)"
           r"(?:\s+letters?)?", r"\btitle[\s-]case\b")
def title(params: dict[str, Any], text: str) -> str | None:
    low = [w for w in text.split() if (first := next((c for c in w if c.isalpha()), "")) and first.islower()]
    return f"{len(low)} words start lower-case, e.g. {low[0]!r}" if low else None


def _word_params(g: dict[str, str | None]) -> dict[str, Any] | None:
    offsets = {"le": ("max", 0), "lt": ("max", -1), "ge": ("min", 0), "gt": ("min", 1), "eq": ("both", 0)}
    params: dict[str, Any] = {}
    for name, (bound, offset) in offsets.items():
        if g.get(name) is None:
            continue
        if (n := parse_number(g[name])) is None:
            return None
        params.update({"min": n, "max": n} if bound == "both" else {bound: n + offset})
    return params


WORDS = r"\s+words?\b"


@rule_kind(
    "words",
    rf"\b(?:no|not)\s+(?:more|longer)\s+than\s+(?P<le>{NUMBER}){WORDS}",
    rf"\b(?:at\s+most|up\s+to|(?:a\s+)?max(?:imum)?(?:\s+of)?|within|not\s+(?:to\s+)?exceed(?:ing)?)\s+(?P<le>{NUMBER}){WORDS}",
    rf"\blimit\w*\b[^.\n]{{0,40}}?\bto\s+(?:(?:at\s+most|a\s+maximum\s+of)\s+)?(?P<le>{NUMBER}){WORDS}",
    rf"\b(?P<le>{NUMBER}){WORDS}\s+or\s+(?:fewer|less)\b", rf"\b(?P<le>{NUMBER})[\s-]words?\s+(?:limit|maximum|max)\b",
    rf"\b(?:fewer|less|shorter)\s+than\s+(?P<lt>{NUMBER}){WORDS}", rf"\b(?:under|below)\s+(?P<lt>{NUMBER}){WORDS}",
    rf"\b(?:at\s+least|(?:no|not)\s+(?:fewer|less)\s+than|(?:a\s+)?min(?:imum)?(?:\s+of)?)\s+(?P<ge>{NUMBER}){WORDS}",
    rf"\b(?P<ge>{NUMBER}){WORDS}\s+or\s+more\b",
    rf"\b(?:more|longer)\s+than\s+(?P<gt>{NUMBER}){WORDS}", rf"\bover\s+(?P<gt>{NUMBER}){WORDS}",
    rf"\b(?:exactly|precisely)\s+(?P<eq>{NUMBER}){WORDS}",
    rf"\bbetween\s+(?P<ge>{NUMBER})\s+and\s+(?P<le>{NUMBER}){WORDS}",
    params=_word_params)
def words(params: dict[str, Any], text: str) -> str | None:
    n = count_words(text)
    low, high = params.get("min", 0), params.get("max", n)
    return None if low <= n <= high else f"{n} words, allowed {low}..{params.get('max', 'any')}"


LANG = rf"(?:(?:simplified|traditional|standard|modern|plain)\s+)?(?P<lang>{'|'.join((*LANGUAGES, 'Mandarin'))})\b"


@rule_kind(
    "language",
    rf"\b(?:respond|reply|answer|write|communicate)\w*\b(?:\s+\w+){{0,4}}?\s+in\s+{LANG}",
    rf"\b(?:response|reply|answer|output)s?\b[^.\n]{{0,30}}?\bin\s+{LANG}",
    rf"\buse\s+only\s+(?:the\s+)?{LANG}", rf"\buse\s+(?:the\s+)?{LANG}(?:\s+language)?\s+only\b",
    params=lambda g: {"language": "Chinese" if g["lang"].lower() == "mandarin" else g["lang"].capitalize()})
def language(params: dict[str, Any], text: str) -> str | None:
    return language_problem(text, params["language"])


RULE_LINE = re.compile(r"^(?:formatting rule|rule|requirement|instruction)s?\s*:\s*(.+)$", re.I | re.M)


def rule_texts(system: str) -> list[str]:
    """Where a system prompt states its rules: its rule lines (`Formatting rule: ...`) if any, else all of it."""
    return RULE_LINE.findall(system) or [system]


def parse_rules(text: str) -> list[Rule]:
    """Every rule stated in `text`, in the order stated; overlapping phrasings go to the longest match."""
    found = sorted(((m, kind, params) for kind, pattern, params in PHRASINGS for m in pattern.finditer(text)),
                   key=lambda x: (x[0].start() - x[0].end(), x[0].start()))
    chosen: list[tuple[tuple[int, int], Rule]] = []
    for m, kind, params in found:
        if any(m.start() < end and start < m.end() for (start, end), _ in chosen):
            continue
        if (p := params(m.groupdict())) is not None:
            chosen.append((m.span(), Rule(kind, p, m.group(0))))
    return [rule for _, rule in sorted(chosen, key=lambda c: c[0])]


def find_rules(system: str) -> list[Rule]:
    return [rule for text in rule_texts(system) for rule in parse_rules(text)]


def find_rule(system: str) -> Rule | None:
    """The first rule a system prompt states, if any is recognised."""
    return next(iter(find_rules(system)), None)


def check_rule(rule: Rule, reply: str) -> str | None:
    """None if the (stripped) reply obeys the rule, else why not."""
    return CHECKS[rule.kind](rule.params, reply)


def nested_verdict(system: str, reply: str) -> tuple[int | None, str]:
    """(1 / 0, why) for a reply under the system prompt's rules, or (None, why) when they cannot be judged.

    A broken recognised rule scores 0 even when another rule line is not understood; otherwise every
    rule line must be recognised (and every recognised rule obeyed) to score 1.
    """
    texts = rule_texts(system)
    parsed = [(text, parse_rules(text)) for text in texts]
    rules = [rule for _, found in parsed for rule in found]
    broken = [f"breaks rule {rule.kind} ({why})" for rule in rules if (why := check_rule(rule, reply))]
    if broken:
        return 0, "; ".join(broken)
    unknown = [text for text, found in parsed if not found]
    if unknown:
        where = "the system prompt" if texts == [system] else "; ".join(repr(t) for t in unknown)
        return None, f"no formatting rule recognised in {where}"
    return 1, "obeys rule " + ", ".join(rule.kind for rule in rules)
