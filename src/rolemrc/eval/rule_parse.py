"""Nested formatting rules: parsed from the system prompt's wording, each checked exactly on the reply.

This is eval's own verifier: it never imports the datagen package, so a bug in the generator's rules shows
up here instead of being graded by itself, and rules phrased in other ways (the RoleMRC release's, IFEval's)
are judged too. Each rule kind registers its phrasings (regexes whose named groups carry the parameters)
and one checker (rule_registry); this module holds the kinds below and the parsing, rule_counts and
rule_layout hold IFEval's other instruction types. Where phrasings overlap, the longest match wins, so "Do not
use any capital letters" is `lower`, not `upper`. A clause is judged only if its phrasings and FILLER words
explain every word of it: "Do not answer in English", "End every sentence with a period" or "Use two emojis and
mention your childhood" are not understood (unjudgeable), never read as the rule they contain. The kinds and what
they check:

- emoji: begins / ends (or not) with an emoji; at least N, exactly N, at most N, fewer / more than N or no
  emojis ("emojis" with no number: at least one, and one alone cannot be told)
- keyword: the words (one, or a list) appear (any case, inflections count) / none appears as a word
- ends_with: ends (or not) with the given phrase or punctuation mark (a phrase found only in another case, inside
  the reply's quotes or before a final full stop: CannotTell)
- forbidden_mark: none of the named commas / exclamation marks / question marks / semicolons / colons / periods
- upper / lower / title: no lower-case letters / no capitals / every word starts with a capital (no letters with
  a case: CannotTell)
- words: at most, fewer than, at least, more than, exactly or between N words (digits or words), counted both as
  whitespace separates them and as IFEval does (runs of letters and digits); where the two disagree, CannotTell
- language: written in the language (text_facts.language_problem says how that is told; too short to tell
  is CannotTell)
"""

from __future__ import annotations

import re
from typing import Any

from rolemrc.eval import rule_counts, rule_layout  # noqa: F401  (they register their rule kinds)
from rolemrc.eval.rule_registry import (
    CHECKS,
    END,
    NOT,
    NOT_MORE,
    PHRASINGS,
    QUOTED,
    REQUEST,
    WORD,
    Rule,
    outside,
    rule_kind,
    shown,
)
from rolemrc.eval.text_facts import (
    LANGUAGES,
    NUMBER,
    CannotTell,
    count_words,
    emojis,
    ends_with_emoji,
    language_problem,
    parse_number,
    starts_with_emoji,
    word_tokens,
)


def _count(text: str | None) -> int | None:
    """An emoji count as stated; "an", "some", "one or more" or none stated mean at least one."""
    vague = text is None or " ".join(text.lower().split()) in ("a", "an", "some", "one or more")
    return 1 if vague else parse_number(text)


def _emoji_params(g: dict[str, str | None]) -> dict[str, Any] | None:
    if g.get("start") is not None or g.get("end") is not None:
        return {"at": "start" if g.get("start") is not None else "end", "negated": g.get("negated") is not None}
    if g.get("none") is not None:
        return {"max": 0}
    for group, bound, offset in (("most", "max", 0), ("lt", "max", -1), ("gt", "min", 1)):
        if g.get(group) is not None:
            return None if (n := _count(g[group])) is None else {bound: n + offset}
    if g.get("plural") is not None:
        return {"min": 1, "plural": True}
    n = _count(g.get("n"))
    return None if n is None else {"min": n, **({"max": n} if g.get("exactly") else {})}


EMOJI_VERB = r"(?:include|use|add|insert|put|contain|incorporate|sprinkl|scatter|pepper|feature|employ|ha(?:ve|s))\w*"


@rule_kind(
    "emoji",
    rf"(?:(?P<negated>{NOT})\s+)?\b(?:begin|start|open)\w*\b(?P<gap>[^.\n]{{0,40}}?)\bwith\s+(?:an?|one|a\s+single|any)\s+emojis?\b"
    r"(?P<start>)",
    r"\bemoji\s+(?:at|as)\s+the\s+(?:very\s+)?(?:start|beginning|first\s+character)\b(?P<start>)",
    rf"(?:(?P<negated>{NOT})\s+)?{END}(?P<gap>[^.\n]{{0,40}}?)\bwith\s+(?:an?|one|a\s+single|any)\s+emojis?\b(?P<end>)",
    r"\bemoji\s+(?:at|as)\s+the\s+(?:very\s+)?(?:end|last\s+character)\b(?P<end>)",
    rf"{NOT}\s+(?:(?:us|includ|add|insert|put)\w*\s+)?(?:any\s+)?emojis?\b(?P<none>)",
    r"\bno\s+emojis?\b(?P<none>)", r"\bemoji-free\b(?P<none>)",
    rf"(?:\b(?:at\s+most|up\s+to|a\s+maximum\s+of)|{NOT_MORE})\s+(?P<most>{NUMBER})\s+emojis?\b",
    rf"\b(?P<most>{NUMBER})\s+emojis?\s+or\s+(?:fewer|less)\b", rf"\b(?:fewer|less)\s+than\s+(?P<lt>{NUMBER})\s+emojis?\b",
    rf"\bmore\s+than\s+(?P<gt>{NUMBER})\s+emojis?\b",
    rf"\b{EMOJI_VERB}\s+(?:(?P<exactly>exactly)\s+|(?:at\s+least|a\s+minimum\s+of)\s+)?"
    rf"(?P<n>{NUMBER}|an?|some|one\s+or\s+more)\s+emojis?\b",
    rf"\b(?:(?P<exactly>exactly)\s+|(?:at\s+least|a\s+minimum\s+of)\s+)(?P<n>{NUMBER})\s+emojis?\b",
    rf"\b(?P<n>{NUMBER})\s+or\s+more\s+emojis\b", rf"\b{EMOJI_VERB}\s+(?:some\s+)?emojis\b(?P<plural>)",
    rf"\b{EMOJI_VERB}(?P<gap>[^.\n]{{0,30}}?)\bwith\s+(?:some\s+)?emojis\b(?P<plural>)",
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
    if n == 1 and params.get("plural"):
        raise CannotTell("one emoji where emojis are asked for")
    if n < params.get("min", 0) or n > params.get("max", n):
        return f"{n} emojis"
    return None


NAMED = r"(?:the\s+)?(?:exact\s+)?(?:word|phrase|term|keyword|expression)"
ITEM = r"(?:['\"‘“][^'\"’”\n]+['\"’”]|[\w'-]+)"
# a list: ['a', 'b'] as IFEval prints it, or "a", "b" and "c" (bare words only after a plural noun)
ITEMS = (rf"(?P<list>\[\s*{ITEM}(?:\s*,\s*{ITEM})*\s*\]|{ITEM}(?:\s*,\s*(?:and\s+|or\s+|nor\s+)?{ITEM}|"
         rf"\s+(?:and|or|nor)\s+{ITEM})*)")
NAMED_ALL = r"(?:the\s+)?(?:following\s+)?(?:exact\s+)?(?:words|phrases|terms|keywords|expressions)\s*:?"


def _keyword_params(g: dict[str, str | None]) -> dict[str, Any] | None:
    """The words of a one-word match or of a list; "or" between them only where they are forbidden."""
    forbidden = g.get("forbidden") is not None
    if g.get("list") is None:
        return {"words": [g["quoted"] or g["bare"]], "forbidden": forbidden}
    text = g["list"].strip("[] ")
    if re.search(r"\b(?:or|nor)\s", text) and not forbidden:
        return None
    quoted = re.findall(r"['\"‘“]([^'\"’”\n]+)['\"’”]", text)
    items = quoted or [w for w in re.split(r"\s*,\s*|\s+", text) if w.lower() not in ("and", "or", "nor", "")]
    return {"words": items, "forbidden": forbidden}


@rule_kind(
    "keyword",
    rf"\b(?:use|include|mention|say|contain|incorporate|feature)\w*\s+{NAMED}\s+{WORD}",
    rf"\bthe\s+(?:word|phrase|term|keyword)\s+{WORD}\s+(?:must|should|has\s+to)\s+(?:appear|be\s+(?:used|included))",
    rf"{NOT}\s+(?:(?:us|includ|mention|say|writ|contain)\w*\s+)?{NAMED}\s+{WORD}(?P<forbidden>)",
    rf"\bthe\s+(?:word|phrase|term)\s+{WORD}\s+(?:(?:must|should)\s+not\s+appear|is\s+(?:forbidden|not\s+allowed))"
    r"(?P<forbidden>)",
    rf"\b(?:use|include|mention|contain|incorporate|feature)\w*\s+(?:all\s+(?:of\s+)?)?{NAMED_ALL}\s*{ITEMS}",
    rf"{NOT}\s+(?:(?:us|includ|mention|say|writ|contain)\w*\s+)?(?:any\s+(?:of\s+)?)?{NAMED_ALL}\s*{ITEMS}"
    r"(?P<forbidden>)",
    params=_keyword_params)
def keyword(params: dict[str, Any], text: str) -> str | None:
    """Each word appears (any case, inside longer words too), or none appears as a word of its own."""
    if params["forbidden"]:
        used = [w for w in params["words"] if re.search(rf"(?<!\w){re.escape(w)}(?!\w)", text, re.I)]
        return f"uses {', '.join(map(repr, used))}" if used else None
    missing = [w for w in params["words"] if w.lower() not in text.lower()]
    return f"no {', '.join(map(repr, missing))}" if missing else None


MARKS = {"question": "?", "exclamation": "!", "period": ".", "full": "."}


def _ending_params(g: dict[str, str | None]) -> dict[str, Any] | None:
    """An unquoted phrase runs to the end of the line that states the rule; one holding two sentences is not
    one phrase to end with (where would it stop?)."""
    if g.get("mark"):
        return {"negated": g.get("negated") is not None, "text": MARKS[g["mark"].split()[0].lower()], "mark": True}
    text = g.get("quoted") or g["rest"] or ""
    if not g.get("quoted") and re.search(r"[.!?]\s+\S", text):
        return None
    return {"negated": g.get("negated") is not None, "text": text, "mark": False}


PHRASE = r"with\s+(?:the\s+|this\s+)?(?:(?:exact|following|same)\s+)*"
NO_MORE = r"no\s+other\s+words\s+should\s+follow\s+(?:this|the|that)\s+phrase\b"
NOTHING_AFTER = rf"(?:[\s.]*{NO_MORE})?"


@rule_kind(
    "ends_with",
    rf"(?:(?P<negated>{NOT})\s+)?{END}(?P<gap>[^.\n:]{{0,40}}?)\bwith\s+(?:an?\s+|the\s+|one\s+)?"
    r"(?P<mark>question\s+mark|exclamation\s+(?:mark|point)|period|full\s+stop)\b",
    rf"(?:(?P<negated>{NOT})\s+)?{END}(?P<gap>[^.\n:'\"‘“]{{0,40}}?)\b{PHRASE}(?:(?:sentence|phrase|words?|line|"
    rf"sign-?off)\b\s*:?\s*)?{QUOTED}{NOTHING_AFTER}",
    rf"^(?P<gap_lead>[^\S\n]*(?:[\w']+[^\S\n]+)*?)(?:(?P<negated>{NOT})\s+)?{END}(?P<gap>[^.\n:'\"‘“]{{0,40}}?)\b{PHRASE}"
    r"(?:sentence|phrase|words?|line|sign-?off)\b\s*:?\s*(?P<rest>[^'\"‘“\s].*?)\s*$",
    rf"(?:(?P<negated>{NOT})\s+)?{END}(?P<gap>[^.\n:'\"‘“]{{0,40}}?)\b{PHRASE}(?:sentence|phrase|words?|line|sign-?off)\b"
    rf"\s*:?\s*(?P<rest>[^'\"‘“\s][^\n]*?)\.?\s+{NO_MORE}\.?",
    params=_ending_params)
def ends_with(params: dict[str, Any], text: str) -> str | None:
    """A mark may be followed by closing quotes or brackets; a phrase ending in a letter by a full stop. Where
    that reading and IFEval's (any case, the reply's double quotes stripped, nothing after) differ, CannotTell."""
    end, tail = params["text"], text.rstrip()
    if params["mark"]:
        tail = tail.rstrip("\"'”’»)]")
    elif end[-1:].isalnum():
        tail = tail.rstrip(".!?")
    if not params["mark"] and tail.endswith(end) != text.strip().strip('"').lower().endswith(end.lower()):
        raise CannotTell(f"ends with {end!r} only if case, quotes or a final mark do not count")
    if tail.endswith(end) == params["negated"]:
        return f"ends with {end!r}" if params["negated"] else f"does not end with {end!r}"
    return None


MARK_CHARS = {"comma": ",，、،", "exclamation": "!！", "question": "?？", "semicolon": ";；", "colon": ":：",
              "period": ".。", "full": ".。"}
ONE_MARK = r"(?:commas?|exclamation\s+(?:marks?|points?)|question\s+marks?|semicolons?|colons?|periods|full\s+stops)"
MARK_NAME = rf"(?P<mark>{ONE_MARK}(?:\s*,\s*(?:or\s+|and\s+)?{ONE_MARK}|\s+(?:or|and|nor)\s+{ONE_MARK})*)"


@rule_kind(
    "forbidden_mark",
    rf"{NOT}\s+(?:(?:us|includ|put|add|writ|contain)\w*\s+|the\s+use\s+of\s+)?(?:any\s+|a\s+single\s+|an?\s+)?"
    rf"{MARK_NAME}\b",
    rf"\bno\s+{MARK_NAME}\b", rf"\b{MARK_NAME}\s+(?:are|is)\s+not\s+(?:allowed|permitted)\b",
    r"\b(?P<mark>comma)-free\b",
    params=lambda g: {"marks": [m.split()[0].lower().rstrip("s") for m in re.findall(ONE_MARK, g["mark"], re.I)]})
def forbidden_mark(params: dict[str, Any], text: str) -> str | None:
    found = {mark: n for mark in params["marks"] if (n := sum(text.count(c) for c in MARK_CHARS[mark]))}
    return ", ".join(f"{n} {mark} mark(s)" for mark, n in found.items()) or None


CAPITALS = r"(?:capital|upper[\s-]?case)\s+letters"


UPPER = rf"(?:{CAPITALS}|upper[\s-]?case)"


@rule_kind("upper", rf"(?:(?<=\bin\s)|(?<=\ball\s)|(?<=\bonly\s)){UPPER}\b|\b{UPPER}\s+only\b",
           r"\b(?:all[\s-]caps|block\s+capitals|in\s+capitals)\b",
           rf"{NOT}\s+(?:(?:us|includ|writ)\w*\s+)?(?:any\s+)?lower[\s-]?case(?:\s+letters)?\b",
           r"\bcapitali[sz]e\s+(?:all|every)\s+letters?\b")
def upper(params: dict[str, Any], text: str) -> str | None:
    return cased(text) or ("has lower-case letters" if any(c.islower() for c in text) else None)


@rule_kind("lower", r"\blower[\s-]?case(?:\s+letters)?\b", rf"\bno\s+{CAPITALS}\s+(?:are\s+)?(?:allowed|permitted)\b",
           rf"{NOT}\s+(?:(?:us|includ|writ)\w*\s+)?(?:any\s+)?{CAPITALS}\b",
           rf"\bno\s+{CAPITALS}\b", r"\bno\s+capitali[sz]ation\b", rf"{NOT}\s+capitali[sz]e\b")
def lower(params: dict[str, Any], text: str) -> str | None:
    return cased(text) or ("has capital letters" if any(c.isupper() for c in text) else None)


def cased(text: str) -> None:
    """Nothing; CannotTell where the text has no letter with a case (is a reply of digits in capitals?)."""
    if not any(c.isupper() or c.islower() for c in text):
        raise CannotTell("no letters with a case")


@rule_kind("title", r"\bcapitali[sz]e\s+(?:the\s+first\s+letter\s+of\s+)?(?:every|each|all(?:\s+the)?)\s+words?\b",
           r"\b(?:start|begin)\w*\s+(?:every|each)\s+word\s+with\s+(?:a\s+)?(?:capital|upper[\s-]?case)(?:\s+letters?)?",
           r"\b(?:every|each)\s+word\b(?P<gap>[^.\n]{0,30}?)\b(?:start|begin)\w*\s+with\s+(?:a\s+)?(?:capital|upper[\s-]?case)"
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
    rf"(?:\b(?:no|not)\s+longer\s+than|{NOT_MORE})\s+(?P<le>{NUMBER}){WORDS}",
    rf"\b(?:at\s+most|up\s+to|(?:a\s+)?max(?:imum)?(?:\s+of)?|within|not\s+(?:to\s+)?exceed(?:ing)?)\s+(?P<le>{NUMBER}){WORDS}",
    rf"\blimit\w*\b(?P<gap>[^.\n]{{0,40}}?)\bto\s+(?:(?:at\s+most|a\s+maximum\s+of)\s+)?(?P<le>{NUMBER}){WORDS}",
    rf"\b(?P<le>{NUMBER}){WORDS}\s+or\s+(?:fewer|less)\b", rf"\b(?P<le>{NUMBER})[\s-]words?\s+(?:limit|maximum|max)\b",
    rf"\b(?:fewer|less|shorter)\s+than\s+(?P<lt>{NUMBER}){WORDS}", rf"\b(?:under|below)\s+(?P<lt>{NUMBER}){WORDS}",
    rf"\b(?:at\s+least|(?:no|not)\s+(?:fewer|less)\s+than|(?:a\s+)?min(?:imum)?(?:\s+of)?)\s+(?P<ge>{NUMBER}){WORDS}",
    rf"\b(?P<ge>{NUMBER}){WORDS}\s+or\s+more\b",
    rf"\b(?:more|longer)\s+than\s+(?P<gt>{NUMBER}){WORDS}", rf"\bover\s+(?P<gt>{NUMBER}){WORDS}",
    rf"\b(?:exactly|precisely)\s+(?P<eq>{NUMBER}){WORDS}",
    rf"\bbetween\s+(?P<ge>{NUMBER})\s+and\s+(?P<le>{NUMBER}){WORDS}",
    params=_word_params)
def words(params: dict[str, Any], text: str) -> str | None:
    """Words as whitespace separates them and as IFEval counts them (runs of letters and digits) must agree."""
    counts = {count_words(text), word_tokens(text)}
    broken = {outside(n, params) for n in counts}
    if len(broken) > 1:
        raise CannotTell(f"{' or '.join(map(str, sorted(counts)))} words (how to count them decides), {shown(params)}")
    return f"{count_words(text)} words, {shown(params)}" if broken.pop() else None


LANG = (rf"(?:(?:simplified|traditional|standard|modern|plain)\s+)?(?P<lang>{'|'.join((*LANGUAGES, 'Mandarin'))})\b"
        r"(?:\s+language)?(?:\s*,?\s*(?:and\s+)?no\s+other\s+language\s+is\s+(?:allowed|permitted))?")


@rule_kind(
    "language",
    rf"\b(?:respond|reply|answer|write|communicate)\w*\b(?P<gap>(?:\s+\w+){{0,4}}?)\s+in\s+{LANG}",
    rf"\b(?:response|reply|answer|output)s?\b(?P<gap>[^.\n]{{0,30}}?)\bin\s+{LANG}",
    rf"\buse\s+only\s+(?:the\s+)?{LANG}", rf"\buse\s+(?:the\s+)?{LANG}(?:\s+language)?\s+only\b",
    params=lambda g: {"language": "Chinese" if g["lang"].lower() == "mandarin" else g["lang"].capitalize()})
def language(params: dict[str, Any], text: str) -> str | None:
    return language_problem(text, params["language"])


RULE_LINE = re.compile(r"^(?:formatting rule|rule|requirement|instruction)s?\s*:\s*(.+)$", re.I | re.M)
# Words a rule's wording may carry besides what its phrasing matched: anything else (a negation, a number,
# "every sentence", "mention your childhood") means the clause says more than was understood.
FILLER = frozenset((
    "a", "all", "also", "always", "an", "and", "answer", "answers", "any", "at", "be", "contain", "contains", "do",
    "entire", "entirely", "every", "for", "give", "have", "in", "include", "is", "it", "keep", "kindly", "least",
    "long", "make", "must", "of", "once", "only", "please", "provide", "replies", "reply", "respond", "response",
    "responses", "should", "somewhere", "stay", "strictly", "sure", "the", "through", "throughout", "to", "use",
    "user", "using", "whatsoever", "whole", "with", "write", "written", "you", "your",
))
CLAUSE_END = re.compile(r"[.!?;]+(?=\s|$)|\n")
WORD_TOKEN = re.compile(r"[^\W_]+")


def rule_texts(system: str) -> list[str]:
    """Where a system prompt states its rules: its rule lines (`Formatting rule: ...`) if any, else all of it."""
    return RULE_LINE.findall(system) or [system]


def unexplained(text: str) -> list[str]:
    """The words of `text` that no phrasing explains (FILLER words aside)."""
    return [w for w in WORD_TOKEN.findall(text) if w.lower() not in FILLER]


def parse_rules(text: str, every_clause: bool) -> tuple[list[Rule], list[str]]:
    """The rules stated in `text` in order, and its clauses not understood (all of `text` if no rule is).

    Overlapping phrasings go to the longest match; a match whose gaps (groups named `gap...`) hold unexplained
    words is no match. A clause that states a rule but says more than its phrasings and FILLER words explain counts
    none of its rules and is not understood; so is any unexplained clause of a rule line (`every_clause`),
    while in a whole system prompt the clauses stating no rule are the role's description.
    """
    found = sorted(((m, kind, params) for kind, pattern, params in PHRASINGS for m in pattern.finditer(text)),
                   key=lambda x: (x[0].start() - x[0].end(), x[0].start()))
    chosen: list[tuple[tuple[int, int], Rule]] = []
    for m, kind, params in found:
        if any(m.start() < end and start < m.end() for (start, end), _ in chosen):
            continue
        gaps = " ".join(value for name, value in m.groupdict().items() if name.startswith("gap") and value)
        if not unexplained(gaps) and (p := params(m.groupdict())) is not None:
            chosen.append((m.span(), Rule(kind, p, m.group(0))))
    chosen.sort(key=lambda c: c[0])
    masked = text
    for (start, end), _ in chosen:
        masked = masked[:start] + " " * (end - start) + masked[end:]
    rules: list[Rule] = []
    unknown: list[str] = []
    start = 0
    for stop in [m.end() for m in CLAUSE_END.finditer(masked)] + [len(text)]:
        stated = [rule for (at, _), rule in chosen if start <= at < stop]
        if unexplained(masked[start:stop]) and (stated or every_clause):
            unknown.append(text[start:stop].strip())
        else:
            rules += stated
        start = stop
    return rules, unknown if rules or unknown else [text.strip()]


def parse_system(system: str) -> list[tuple[list[Rule], list[str]]]:
    """parse_rules over each of the system prompt's rule texts."""
    texts = rule_texts(system)
    return [parse_rules(text, every_clause=texts != [system]) for text in texts]


def find_rules(system: str) -> list[Rule]:
    """Every rule the system prompt states that is understood."""
    return [rule for rules, _ in parse_system(system) for rule in rules]


def find_rule(system: str) -> Rule | None:
    """The first rule a system prompt states, if any is recognised."""
    return next(iter(find_rules(system)), None)


def check_rule(rule: Rule, reply: str, request: str = "") -> str | None:
    """None if the (stripped) reply to the user's `request` obeys the rule, else why not; CannotTell if that cannot
    be decided."""
    return CHECKS[rule.kind]({**rule.params, REQUEST: request}, reply)


def nested_verdict(system: str, reply: str, request: str = "") -> tuple[int | None, str]:
    """(1 / 0, why) for a reply to the user's `request` under the system prompt's rules, or (None, why) when they
    cannot be judged.

    A broken understood rule scores 0 even when another clause is not understood or another rule cannot be
    told on this reply; otherwise every rule clause must be understood (parse_rules), and every rule decided
    and obeyed, to score 1.
    """
    parsed = parse_system(system)
    rules = [rule for found, _ in parsed for rule in found]
    broken, untold = [], []
    for rule in rules:
        try:
            if why := check_rule(rule, reply, request):
                broken.append(f"breaks rule {rule.kind} ({why})")
        except CannotTell as e:
            untold.append(f"cannot tell rule {rule.kind} ({e})")
    if broken:
        return 0, "; ".join(broken)
    unknown = [clause for _, clauses in parsed for clause in clauses]
    if unknown:
        where = "the system prompt" if unknown == [system.strip()] else "; ".join(repr(t) for t in unknown)
        return None, f"no formatting rule understood in {where}"
    if untold:
        return None, "; ".join(untold)
    return 1, "obeys rule " + ", ".join(rule.kind for rule in rules)
