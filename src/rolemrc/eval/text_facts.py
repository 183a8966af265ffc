"""Facts about a reply that the nested-rule checkers need: emojis, words, numbers in words, language.

Deliberately simple and stated: a word is a whitespace-separated token (each Chinese or Japanese
character counts as one, as these scripts put no spaces between words); the language of Latin-script
text is told by the common function words it uses; Chinese, Japanese, Korean, Russian, Arabic,
Hindi, Greek and Hebrew are told by their script alone (so Russian cannot be told from Ukrainian).
A reply too short to tell (too few function words, kanji without kana) raises CannotTell instead of a verdict.
"""

from __future__ import annotations

import re
from itertools import pairwise

from rolemrc.core.errors import RolemrcError

_PICTO = "\U0001F000-\U0001FAFF\u2600-\u27BF\u2B50\u2B55\u231A\u231B\u23E9-\u23FA"
EMOJI = re.compile(f"[\U0001F1E6-\U0001F1FF]{{2}}|[{_PICTO}](?:\uFE0F|[\U0001F3FB-\U0001F3FF]|\u200D[{_PICTO}])*")
_CJK = "\u3040-\u30FF\u3400-\u4DBF\u4E00-\u9FFF\uF900-\uFAFF"  # written without spaces between words
_WORD = re.compile(f"[{_CJK}]|[^\\s{_CJK}]+")

_UNITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
          "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")
_TENS = {word: 10 * (i + 2)
         for i, word in enumerate(("twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"))}
_SCALES = {"hundred": 100, "thousand": 1000}
NUMBER_WORD = "|".join(sorted((*_UNITS, *_TENS, *_SCALES), key=len, reverse=True))
NUMBER = rf"(?:\d+|(?:{NUMBER_WORD})(?:(?:\s+and\s+|[\s-]+)(?:{NUMBER_WORD}))*)\b"


class CannotTell(RolemrcError):
    """A recognised rule whose check cannot be decided honestly on this reply; the message says why (caught by the
    nested verifier, which calls the verdict unjudgeable)."""


def emojis(text: str) -> list[str]:
    """The emojis in `text`; a flag, a skin-toned or a ZWJ-joined emoji counts once."""
    return EMOJI.findall(text)


def starts_with_emoji(text: str) -> bool:
    return bool(EMOJI.match(text))


def ends_with_emoji(text: str) -> bool:
    return any(m.end() == len(text) for m in EMOJI.finditer(text))


def count_words(text: str) -> int:
    """Whitespace-separated tokens, each Chinese or Japanese character counted as a word of its own."""
    return len(_WORD.findall(text))


def word_tokens(text: str) -> int:
    """Runs of letters, digits and underscores: how IFEval counts words ("don't" is two, a dash none)."""
    return len(re.findall(r"\w+", text))


# The words Punkt's English model (NLTK's punkt_tab) reads as abbreviations, those without inner periods
_ABBREVIATIONS = frozenset((
    "adm", "ala", "ariz", "aug", "ave", "bros", "calif", "chg", "cie", "co", "col", "colo", "conn", "corp", "cos",
    "ct", "dec", "dr", "feb", "fla", "fri", "ft", "ga", "gen", "ill", "inc", "jan", "jr", "kan", "ky", "lt", "ltd",
    "maj", "messrs", "mg", "mich", "minn", "mr", "mrs", "ms", "nev", "nov", "oct", "ok", "okla", "ore", "pa", "prof",
    "rep", "reps", "sen", "sep", "sept", "sr", "st", "sw", "tenn", "tues", "va", "vs", "vt", "wash", "wed", "wis",
    "yr",
))
_CLOSERS = "\"'”’)]}*"


def sentence_range(text: str) -> tuple[int, int]:
    """The fewest and most sentences a Punkt-style splitter can find: a break follows [.!?] and whitespace; one
    after an ellipsis, a number, an initial, an abbreviation or before a lower-case word is a maybe, and so is a mark
    right after the end (a sentence of its own unless it is a closing quote or bracket).
    Line breaks alone split nothing."""
    tokens = text.split()
    sure = maybe = 0
    for token, following in pairwise(tokens):
        core = token.rstrip(_CLOSERS)
        if core.endswith(("?", "!")):
            sure += 1
        elif core.endswith("."):
            word = core.rstrip(".").rsplit("-", 1)[-1].lstrip(_CLOSERS + "\"'“‘([{")
            doubtful = (core.endswith("..") or "." in word or len(word) == 1 or not word.isalpha()
                        or word.lower() in _ABBREVIATIONS or following.lstrip(_CLOSERS + "“‘([{")[:1].islower())
            maybe += doubtful
            sure += not doubtful
    # a mark Punkt also splits at, right after the end of a sentence ("out.*", 'said.".'): maybe one more
    maybe += sum(bool(re.search(r"[.?!](?=[?!)\";}\]*:@'({\[])", t.rstrip("\"')]}’”"))) for t in tokens)
    start = 1 if tokens else 0
    return start + sure, start + sure + maybe


def capital_word_range(text: str) -> tuple[int, int]:
    """The fewest and most words in capitals (str.isupper, as IFEval checks: "I" and "A1" count) a Treebank-style
    tokenizer can find: a contraction splits off ("DON'T" is "DO" and "N'T", "NASA's" is "NASA" and "'s"); a word
    holding other marks may split in two or not."""
    low = high = 0
    for token in text.split():
        core = re.sub(r"^\W+|\W+$", "", token)
        if not any(c.isupper() for c in core):
            continue
        clitic = re.fullmatch(r"([^\W_]+?)(n't|'s|'m|'d|'ll|'re|'ve)", core, re.I)
        parts = clitic.groups() if clitic else [core]
        if all(c.isalnum() or c == "-" for c in parts[0]) and "--" not in parts[0]:
            low += sum(p.isupper() for p in parts)
            high += sum(p.isupper() for p in parts)
        else:
            high += 2
    return low, high


def parse_number(text: str) -> int | None:
    """An integer written in digits or English words ("12", "twenty-five", "one hundred and fifty")."""
    text = text.strip().lower()
    if text.isdigit():
        return int(text)
    total = current = 0
    for token in re.split(r"[\s-]+", text):
        if token in _UNITS:
            current += _UNITS.index(token)
        elif token in _TENS:
            current += _TENS[token]
        elif token in _SCALES:
            current = max(current, 1) * _SCALES[token]
            if token == "thousand":
                total, current = total + current, 0
        elif token != "and":
            return None
    return total + current


_SCRIPTS = {
    "Chinese": "\u3400-\u4DBF\u4E00-\u9FFF\uF900-\uFAFF", "Japanese": "\u3040-\u30FF\u3400-\u4DBF\u4E00-\u9FFF",
    "Korean": "\uAC00-\uD7AF\u1100-\u11FF", "Russian": "\u0400-\u04FF", "Arabic": "\u0600-\u06FF\u0750-\u077F",
    "Hindi": "\u0900-\u097F", "Greek": "\u0370-\u03FF", "Hebrew": "\u0590-\u05FF", "Bengali": "\u0980-\u09FF",
    "Thai": "\u0E00-\u0E7F", "Tamil": "\u0B80-\u0BFF", "Telugu": "\u0C00-\u0C7F", "Kannada": "\u0C80-\u0CFF",
    "Gujarati": "\u0A80-\u0AFF", "Punjabi": "\u0A00-\u0A7F", "Malayalam": "\u0D00-\u0D7F", "Ukrainian": "\u0400-\u04FF",
}
# Letters of another language written in the same script, and letters without which the script's languages
# cannot be told apart (Russian from Ukrainian or Bulgarian): either is CannotTell, the first without the second fails
_SCRIPT_DOUBTS = {"Russian": ("[іїєґІЇЄҐ]", "[ыэёЫЭЁ]"), "Ukrainian": ("[ыэёЫЭЁ]", "[іїєґІЇЄҐ]"),
                  "Arabic": ("[پچژگکیٹڈڑںےھ]", ""), "Hindi": ("ळ", "")}
_FUNCTION_WORDS = {name: frozenset(words.split()) for name, words in {
    "English": "the and is are was were of to in that it with for you this have not be but what my your i they yes "
               "we she his her our their them us did can would could should just now out up from by if here there how "
               "when where why who which very been has had its thank thanks please hello sure today",
    "French": "le la les et est sont une des du que qui pas je vous nous avec pour dans ce cette mais il elle au aux "
              "oui non merci bonjour très bien suis ici aussi mon mes beaucoup",
    "Spanish": "el la los las y es son una del que no por para con pero muy está yo usted su lo como más sí también "
               "gracias hola estoy aquí ahora",
    "Portuguese": "o os as e é são um uma do da dos das não que com para por mas muito está eu você isso sim também",
    "Italian": "il lo gli la le e è sono un una di che non per con ma molto io questo della del sì anche grazie ciao",
    "German": "der die das und ist sind ein eine nicht ich sie mit zu auf für es den dem auch wie aber ja nein danke "
              "bitte",
    "Dutch": "de het een en is zijn niet ik van met op voor dat ook maar wat er je nee ja bedankt alstublieft",
    "Polish": "jest się że jak ale czy są przez dla już oraz jestem bardzo tylko",
    "Finnish": "ei että mutta kun niin hän minä sinä olen oli ovat tämä myös",
    "Vietnamese": "là và của không có những một được cho người này với các tôi",
    "Swahili": "wa kwa za katika hii yeye mimi wewe sana kuwa hapa",
}.items()}
LANGUAGES = (*_FUNCTION_WORDS, *_SCRIPTS)
_KANA = re.compile("[\u3040-\u30FF]")


def language_problem(text: str, language: str) -> str | None:
    """None if `text` reads as `language` (one of LANGUAGES), else why not; CannotTell if it is too short to tell.

    Latin-script text reads as the language when it has 2+ of its function words and more than any other
    language's, or none of another's and half its words are the language's (of two letters or more: "Yes, sir.");
    it does not when another language leads by 2+, or has some while the language has none in 4+ words. Text in
    another script reads as a language of that script (Russian needs ы, э or ё; Ukrainian letters, Persian or Urdu
    letters under Arabic and ळ under Hindi are CannotTell; Ukrainian needs і, ї, є or ґ; the other's letters without
    the language's own fail).
    """
    letters = [c for c in text if c.isalpha()]
    if not letters:
        raise CannotTell("no letters")
    if language in _SCRIPTS:
        share = len(re.findall(f"[{_SCRIPTS[language]}]", "".join(letters))) / len(letters)
        if share < 0.5:
            return f"not written in {language} script ({share:.0%} of letters)"
        if language == "Chinese" and _KANA.search(text):
            return "kana present"
        if language == "Japanese" and not _KANA.search(text):
            if len(letters) < 10:
                raise CannotTell(f"{len(letters)} characters without kana: Chinese or Japanese")
            return "no kana (reads as Chinese)"
        other, own = _SCRIPT_DOUBTS.get(language, ("", ""))
        foreign, lacking = bool(other and re.search(other, text)), bool(own and not re.search(own, text))
        if foreign and lacking:
            return f"letters of another language written in {language}'s script, none of its own"
        if foreign or lacking:
            raise CannotTell(f"{language} script, but maybe another language written in it")
        return None
    if sum(ord(c) < 0x250 for c in letters) < len(letters) / 2:
        return "not written in Latin script"
    tokens = re.findall(r"[^\W\d_]+", text.lower())
    hits = {name: sum(t in words for t in tokens) for name, words in _FUNCTION_WORDS.items()}
    own, other = hits.pop(language), max(hits.values())
    why = f"{own} {language} function words, {other} of another language"
    if own >= 2 and own > other:
        return None
    plain = sum(t in _FUNCTION_WORDS[language] for t in tokens if len(t) > 1)
    if not other and 2 * plain >= len(tokens):
        return None     # a short reply, half of it the language's function words of two letters or more ("Yes.")
    if other - own >= 2 or (own == 0 and other and len(tokens) >= 4):
        return why
    raise CannotTell(f"too little to tell: {why}")
