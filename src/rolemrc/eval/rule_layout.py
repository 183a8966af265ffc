"""Nested rules on the reply's shape, checked as IFEval checks them (lm-eval's checkers are the reference):

- divided_paragraphs: N paragraphs separated by the markdown divider *** (no empty one between two dividers)
- paragraph_start: N paragraphs separated by blank lines, paragraph i starting with a word (any case)
- placeholders: N placeholders in square brackets ([address])
- postscript: a postscript starting with P.S. / P.P.S (anywhere on a line, as IFEval looks for it)
- bullets: N markdown bullet points (lines starting with "* " or "-")
- options: the reply contains one of the quoted options ("My answer is yes.")
- highlights: N sections highlighted with markdown, *like this* or **like this**
- sections: N sections, each starting with its marker and a number ("Section 1"); more than N is CannotTell
- json: the whole reply is JSON (markdown ticks around it allowed)
- angle_title: a title in double angular brackets, <<like this>>
- two_responses: two different responses separated by ******
- repeat_request: the reply begins by repeating the user's request word for word (any case)
- quotation: the whole reply is wrapped in double quotation marks (curly ones: CannotTell)
"""

from __future__ import annotations

import json as jsonlib
import re
from typing import Any

from rolemrc.eval.rule_registry import RELATION, REQUEST, bounds, counted, rule_kind
from rolemrc.eval.text_facts import NUMBER, CannotTell, parse_number

REPLY = r"(?:response|reply|answer|output)"
EXAMPLE = r"(?:,?\s*(?:such\s+as|like|e\.g\.|i\.e\.|for\s+example)[,:]?\s*)"
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")
THERE = r"(?:there\s+(?:should|must)\s+be\s+)?"


@rule_kind(
    "divided_paragraphs",
    rf"\b{THERE}(?:(?:split|divide)\w*\s+your\s+{REPLY}\s+into\s+)?(?:exactly\s+)?(?P<n>{NUMBER})\s+paragraphs"
    r"(?:\.\s*paragraphs\s+(?:are|should\s+be|must\s+be)|,?\s*)\s*(?:separated|divided|split)\s+(?:from\s+each\s+other\s+)?"
    r"(?:with|by|using)\s+(?:the\s+)?(?:markdown\s+)?(?:divider|separator)?\s*:?\s*\*\*\*",
    params=lambda g: None if (n := parse_number(g["n"])) is None else {"n": n})
def divided_paragraphs(params: dict[str, Any], text: str) -> str | None:
    parts = re.split(r"\s?\*\*\*\s?", text)
    if any(not p.strip() for p in parts[1:-1]):
        return "an empty paragraph between two dividers"
    n = sum(bool(p.strip()) for p in parts)
    return None if n == params["n"] else f"{n} paragraphs, asked {params['n']}"


BLANK_LINES = (r"(?:paragraphs\s+and\s+only\s+paragraphs\s+are\s+separated\s+with\s+each\s+other\s+by\s+two\s+new\s*lines"
               r"\s+as\s+if\s+it\s+was\s+'\\n\\n'\s+in\s+python|(?:separated|divided)\s+by\s+(?:a\s+)?(?:blank|empty)\s+lines?"
               r"|(?:separated|divided)\s+by\s+two\s+new\s*lines)")
NTH = rf"(?:paragraph\s+(?P<nth>{NUMBER})|the\s+(?P<ordinal>{'|'.join(ORDINALS)})\s+paragraph)"


def _start_params(g: dict[str, str | None]) -> dict[str, Any] | None:
    n = parse_number(g["n"] or "")
    nth = ORDINALS.index(g["ordinal"].lower()) + 1 if g.get("ordinal") else parse_number(g.get("nth") or "")
    word = (g.get("word") or "").lower()
    return None if n is None or nth is None or not word else {"n": n, "nth": nth, "word": word}


@rule_kind(
    "paragraph_start",
    rf"\b{THERE}(?:exactly\s+)?(?P<n>{NUMBER})\s+paragraphs[.,;]?\s*(?:{BLANK_LINES}[.,;]?\s*)?{NTH}\s+(?:must|should)\s+"
    r"(?:start|begin)\s+with\s+(?:the\s+)?word\s+['\"‘“]?(?P<word>[\w'-]+?)['\"’”]?(?=[\s.,;:!?]|$)",
    params=_start_params)
def paragraph_start(params: dict[str, Any], text: str) -> str | None:
    paragraphs = re.split(r"\n\n", text)
    n = sum(bool(p.strip()) for p in paragraphs)
    if n != params["n"]:
        return f"{n} paragraphs, asked {params['n']}"
    paragraph = paragraphs[params["nth"] - 1].strip() if params["nth"] <= n else ""
    if not paragraph:
        return f"no paragraph {params['nth']}"
    first = re.match(r"[^.,?!'\"]*", paragraph.split()[0].lstrip("'").lstrip('"')).group(0).lower()
    return None if first == params["word"] else f"paragraph {params['nth']} starts with {first!r}"


@rule_kind(
    "placeholders",
    rf"\b(?:{RELATION}\s+placeholders|(?P<one>an?|one)\s+placeholder),?\s+(?:(?:represented|written|marked|shown|given)\s+"
    rf"(?:by|with|in|as)\s+|in\s+|using\s+)(?:square\s+)?brackets{EXAMPLE}?(?:\[[^\]\n]*\])?",
    rf"\b(?:{RELATION}\s+placeholders|(?P<one>an?|one)\s+placeholder){EXAMPLE}\[[^\]\n]*\]",
    params=lambda g: {"min": 1} if g.get("one") else bounds(g))
def placeholders(params: dict[str, Any], text: str) -> str | None:
    return counted(len(re.findall(r"\[.*?\]", text)), params, "placeholders")


def _postscript_params(g: dict[str, str | None]) -> dict[str, Any]:
    return {"marker": "P.P.S" if re.match(r"p\.\s?p", g["marker"], re.I) else "P.S."}


MARKER = r"(?P<marker>P\.\s?P\.\s?S\.?|P\.\s?S\.)"


@rule_kind(
    "postscript",
    rf"(?:\bat\s+the\s+end\s+of\s+your\s+{REPLY},?\s+)?\b(?:please\s+)?(?:explicitly\s+)?(?:add|include|append|write|end|finish)"
    rf"\w*\s+(?:your\s+{REPLY}\s+)?(?:with\s+)?(?:a\s+)?post-?script\s+(?:starting|beginning)\s+with\s+{MARKER}",
    rf"\b(?:add|include|append|end\s+with)\w*\s+a\s+{MARKER}(?:\s+at\s+the\s+end)?",
    params=_postscript_params)
def postscript(params: dict[str, Any], text: str) -> str | None:
    pattern = r"\s*p\.\s?p\.\s?s.*$" if params["marker"] == "P.P.S" else r"\s*p\.\s?s\..*$"
    return None if re.search(pattern, text.lower(), re.M) else f"no postscript starting with {params['marker']}"


@rule_kind(
    "bullets",
    rf"\b{RELATION}\s+(?:markdown\s+)?bullet(?:\s+points|s)\b(?:\.\s*use\s+(?:the\s+)?markdown\s+bullet\s+points"
    r"(?:\s+such\s+as:?(?:\s*\n\s*\*[^\n]*)*)?)?",
    params=bounds)
def bullets(params: dict[str, Any], text: str) -> str | None:
    n = len(re.findall(r"^\s*\*[^\*].*$", text, re.M)) + len(re.findall(r"^\s*-.*$", text, re.M))
    return counted(n, params, "bullet points")


OPTION = r"['\"‘“][^'\"’”\n]+['\"’”]"


@rule_kind(
    "options",
    rf"\b(?:answer|respond|reply)\w*\s+with\s+one\s+of(?:\s+the)?(?:\s+following)?(?:\s+options)?\s*:?\s*"
    rf"(?P<options>\(\s*{OPTION}(?:\s*,\s*{OPTION})*\s*\)|\[\s*{OPTION}(?:\s*,\s*{OPTION})*\s*\]|"
    rf"{OPTION}(?:\s*,\s*(?:or\s+)?{OPTION}|\s+or\s+{OPTION})*)",
    params=lambda g: {"options": re.findall(r"['\"‘“]([^'\"’”\n]+)['\"’”]", g["options"])})
def options(params: dict[str, Any], text: str) -> str | None:
    return None if any(option in text for option in params["options"]) else "none of the options"


HIGHLIGHT = rf"highlight\s+{RELATION}\s+(?:sections|parts|phrases)\b(?:\s+(?:in|of)\s+your\s+{REPLY})?"


@rule_kind(
    "highlights",
    rf"\b{HIGHLIGHT}(?:\s+(?:with|using|in)\s+(?:markdown|asterisks)(?:{EXAMPLE}\*[^*\n]+\*)?|{EXAMPLE}\*[^*\n]+\*)",
    rf"\buse\s+markdown\s+to\s+{HIGHLIGHT}(?:{EXAMPLE}\*[^*\n]+\*)?",
    params=bounds)
def highlights(params: dict[str, Any], text: str) -> str | None:
    single = [h for h in re.findall(r"\*[^\n\*]*\*", text) if h.strip("*").strip()]
    double = [h for h in re.findall(r"\*\*[^\n\*]*\*\*", text) if h[2:-2].strip()]
    return counted(len(single) + len(double), params, "highlighted sections")


@rule_kind(
    "sections",
    rf"\b(?:ha(?:ve|s)\s+)?(?P<n>{NUMBER})\s+sections\.\s*mark\s+the\s+beginning\s+of\s+each\s+section\s+with\s+"
    r"(?P<marker>[A-Za-z]+)\s+X\b"
    r"(?:,?\s*such\s+as:?(?:\s*\n\s*(?:(?P=marker)\s+\d+|\[[^\]\n]*\]))*)?",
    rf"\b(?:divide|split|organi[sz]e)\w*\s+(?:your\s+{REPLY}\s+)?into\s+(?P<n>{NUMBER})\s+sections,?\s+(?:each\s+)?"
    r"(?:starting|beginning|marked)\s+with\s+['\"‘“]?(?P<marker>[A-Za-z]+)\s+X['\"’”]?",
    params=lambda g: None if (n := parse_number(g["n"])) is None else {"n": n, "marker": g["marker"]})
def sections(params: dict[str, Any], text: str) -> str | None:
    n = len(re.split(r"\s?" + re.escape(params["marker"]) + r"\s?\d+\s?", text)) - 1
    if n > params["n"]:
        raise CannotTell(f"{n} sections where {params['n']} are asked")
    return None if n == params["n"] else f"{n} sections marked {params['marker']!r}, asked {params['n']}"


@rule_kind(
    "json",
    rf"\b(?:(?:entire|whole)\s+)?{REPLY}\s+(?:should|must)\s+be\s+(?:wrapped|written|formatted|given)\s+in\s+JSON"
    r"(?:\s+format)?(?:\.\s*you\s+(?:can|may)\s+use\s+markdown\s+ticks(?:\s+such\s+as\s+```)?)?",
    rf"\b(?:respond|reply|answer|wrap\s+your\s+(?:entire\s+|whole\s+)?{REPLY})\w*\s+(?:only\s+)?(?:in|with|using)\s+"
    r"(?:valid\s+)?JSON(?:\s+format)?\b",
    r"\b(?:format|write)\s+your\s+(?:entire\s+|whole\s+)?(?:response|reply|answer|output)\s+(?:as|in)\s+(?:valid\s+)?JSON\b")
def json(params: dict[str, Any], text: str) -> str | None:
    body = text.strip()
    for prefix in ("```json", "```Json", "```JSON", "```"):
        body = body.removeprefix(prefix)
    try:
        jsonlib.loads(body.removesuffix("```").strip())
    except ValueError:
        return "not JSON"
    return None


@rule_kind(
    "angle_title",
    r"\b(?:contain|include|have|give|add)\w*\s+(?:your\s+\w+\s+)?a\s+title,?\s+(?:wrapped|enclosed|written|put)?\s*in\s+"
    rf"double\s+angul?ar\s+brackets(?:{EXAMPLE}<<[^>\n]*>>)?")
def angle_title(params: dict[str, Any], text: str) -> str | None:
    titles = re.findall(r"<<[^\n]+>>", text)
    return None if any(t.lstrip("<").rstrip(">").strip() for t in titles) else "no <<title>>"


RESPONSES = r"(?:responses|answers|replies)"


@rule_kind(
    "two_responses",
    rf"\b(?:give|write|provide)\s+two\s+different\s+{RESPONSES}[.,]?\s*(?:(?:the\s+)?{RESPONSES}\s+(?:and\s+only\s+"
    rf"{RESPONSES}\s+)?(?:should|must)\s+be\s+)?separated\s+by\s+(?:6|six)\s+asterisk(?:\s+symbol)?s\s*:?\s*(?:\*{{6}})?")
def two_responses(params: dict[str, Any], text: str) -> str | None:
    parts = text.split("******")
    if any(not p.strip() for p in parts[1:-1]):
        return "an empty response between two separators"
    given = [p.strip() for p in parts if p.strip()]
    if len(given) != 2:
        return f"{len(given)} responses"
    return "the two responses are the same" if given[0] == given[1] else None


@rule_kind(
    "repeat_request",
    r"\bfirst\s+repeat\s+the\s+(?:request|prompt)\s+word\s+for\s+word(?:\s+without\s+change)?,?\s+then\s+"
    r"(?:give|write|provide)\s+your\s+answer(?:\s*\(1\.\s*do\s+not\s+say\s+any\s+words\s+or\s+characters\s+before\s+"
    r"repeating\s+the\s+request;\s*2\.\s*the\s+request\s+you\s+need\s+to\s+repeat\s+does\s+not\s+include\s+this\s+"
    r"sentence\))?",
    r"\b(?:begin|start)\w*\s+by\s+repeating\s+the\s+(?:request|prompt)\s+(?:word\s+for\s+word|verbatim)(?:,?\s+then\s+"
    r"answer(?:\s+it)?)?",
    r"\brepeat\s+the\s+(?:request|prompt)\s+(?:word\s+for\s+word|verbatim)\s+(?:before\s+(?:answering|you\s+answer)"
    r"(?:\s+it)?|first)")
def repeat_request(params: dict[str, Any], text: str) -> str | None:
    """A request of several lines (passages, then a question) may be meant in part: a reply that does not begin
    with all of it is CannotTell."""
    request = params[REQUEST].strip()
    if not request:
        raise CannotTell("no request to repeat")
    if text.lower().startswith(request.lower()):
        return None
    if "\n" in request:
        raise CannotTell("does not begin with the whole request, which has several lines")
    return "does not begin with the request"


@rule_kind(
    "quotation",
    rf"\b(?:wrap|enclose|put|surround)\w*\s+(?:your\s+)?(?:(?:entire|whole)\s+)?(?:{REPLY}\s+)?(?:in|with|within|inside)\s+"
    r"double\s+(?:quotation\s+marks|quotes)")
def quotation(params: dict[str, Any], text: str) -> str | None:
    if len(text) > 1 and text[0] == text[-1] == '"':
        return None
    if text[:1] in "“”„" or text[-1:] in "“”":
        raise CannotTell("curly quotation marks")
    return "not wrapped in double quotation marks"
