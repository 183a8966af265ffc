"""eval's own nested-rule verifier: phrasings the generator never writes, and equality with the generator's
`check_rule` on everything the generator does write."""

from __future__ import annotations

import ast
import contextlib
import random
import subprocess
import sys
from pathlib import Path

import pytest
from datagen_fixtures import small_pool

from rolemrc.core.io import read_jsonl
from rolemrc.core.taxonomy import Aspect
from rolemrc.core.text import NARRATED_SPAN
from rolemrc.eval.rule_parse import check_rule, find_rules
from rolemrc.eval.rules import judge_item, style
from rolemrc.eval.text_facts import CannotTell, count_words, parse_number

EVAL = Path(__file__).resolve().parents[1] / "src" / "rolemrc" / "eval"

# (rule as the system prompt states it, kind, a reply that obeys it, a reply that breaks it)
CASES = [
    # emoji
    ("Include at least two emojis.", "emoji", "Points of equal height 🗺️ on a map 🙂", "Points of equal height 🙂"),
    ("Use an emoji somewhere in your answer.", "emoji", "Equal height ⛰", "Equal height."),
    ("Add exactly three emojis to your reply.", "emoji", "🌟 Equal 🌟 height 🌟", "🌟🌟 Equal height."),
    ("Do not start your reply with an emoji.", "emoji", "Equal height 🙂", "🙂 Equal height"),
    ("Never end your answer with an emoji.", "emoji", "🙂 Equal height.", "Equal height 🙂"),
    ("Do not use any emojis.", "emoji", "Equal height.", "Equal height 🙂"),
    ("Your response must be emoji-free.", "emoji", "Equal height.", "🇫🇷 Equal height."),
    ("Never include emojis in your answer.", "emoji", "Equal height.", "Equal height ☕️"),
    ("Start your response with an emoji.", "emoji", "👍🏽 Equal height.", "Equal height 👍🏽"),
    ("End your reply with an emoji.", "emoji", "Equal height 👨‍👩‍👧", "👨‍👩‍👧 Equal height."),
    ("Use no more than two emojis.", "emoji", "Equal 🙂 height 🙂", "🙂🙂🙂 Equal height."),
    # capitals
    ("Your response must be in all capital letters.", "upper", "POINTS OF EQUAL HEIGHT, 300 M.", "POINTS of height."),
    ("Respond in ALL CAPS.", "upper", "EQUAL HEIGHT!", "Equal height!"),
    ("Do not use any lowercase letters.", "upper", "EQUAL HEIGHT.", "EQUAL HEIGHt."),
    ("Respond in all lowercase letters.", "lower", "points of equal height.", "Points of equal height."),
    ("Do not use any capital letters.", "lower", "equal height, 300 m.", "equal height, 300 M."),
    ("No capitalization at all, please.", "lower", "equal height.", "Equal height."),
    ("Capitalize the first letter of every word.", "title", "Points Of Equal Height (Mostly).", "Points of Height."),
    ("Start each word with a capital letter.", "title", "\"Equal\" Height.", "Equal height."),
    ("Write it in title case.", "title", "Equal Height", "equal Height"),
    # punctuation
    ("Do not use any commas in your response.", "forbidden_mark", "Points of equal height.", "Points, of height."),
    ("Avoid using commas.", "forbidden_mark", "Equal height.", "Equal height，mostly."),
    ("Your answer should contain no commas.", "forbidden_mark", "Equal height.", "Equal, height."),
    ("Refrain from using exclamation marks.", "forbidden_mark", "Equal height.", "Equal height!"),
    ("Question marks are not allowed.", "forbidden_mark", "Equal height.", "Equal height?"),
    ("Never use a semicolon.", "forbidden_mark", "Equal height, roughly.", "Equal height; roughly."),
    ("End your response with a question mark.", "ends_with", "Equal height, right?", "Equal height? Yes."),
    ("Your reply must end with an exclamation point.", "ends_with", "Equal height (really!)", "Equal height."),
    ("Finish your answer with a period.", "ends_with", "Equal height.", "Equal height!"),
    ("Conclude your answer with 'Over and out'.", "ends_with", "Equal height. Over and out", "Over and out. Equal."),
    ("Your response must end with the phrase \"Is there anything else?\"", "ends_with",
     "Equal height. Is there anything else?", "Equal height. Is there anything else"),
    ("Sign off with the words: Yours, Rosa", "ends_with", "Equal height. Yours, Rosa", "Yours, Rosa. Equal height."),
    # keywords
    ("Make sure to include the keyword \"contour\".", "keyword", "Contour lines, yes.", "Lines of equal height."),
    ("Mention the term summit in your reply.", "keyword", "Up to the summit.", "Up to the top."),
    ("The word 'height' must appear in your answer.", "keyword", "Equal heights.", "Equal elevation."),
    ("Do not use the word 'height'.", "keyword", "Equal elevation, heightened.", "Equal height."),
    ("Avoid the word \"map\" entirely.", "keyword", "On the chart.", "On the Map."),
    # word limits
    ("Answer in fewer than 5 words.", "words", "Points of equal height.", "Points of equal height here."),
    ("Keep your answer under five words.", "words", "Equal height points.", "They are points of equal height."),
    ("Limit your answer to twenty-five words.", "words", " ".join(["word"] * 25), " ".join(["word"] * 26)),
    ("Your reply should not exceed ten words.", "words", " ".join(["w"] * 10), " ".join(["w"] * 11)),
    ("Respond with at most 3 words.", "words", "Equal height points.", "Points of equal height."),
    ("Write at least 6 words.", "words", "They join points of equal height.", "Points of equal height."),
    ("Use more than three words.", "words", "Points of equal height.", "Equal height points."),
    ("Answer in exactly four words.", "words", "Points of equal height.", "Equal height."),
    ("Write between two and three words.", "words", "Equal height.", "Height."),
    ("Your answer must be 4 words or fewer.", "words", "Points of equal height.", "Points of equal height, yes."),
    ("Keep to a 5-word limit.", "words", "Points of equal height.", "They join points of equal height."),
    ("Use no more than one hundred and fifty words.", "words", " ".join(["w"] * 150), " ".join(["w"] * 151)),
    ("Answer in fewer than 4 words.", "words", "等高线", "Points of equal height."),
    # language
    ("Respond in Spanish.", "language", "Son puntos de la misma altura sobre el nivel del mar.",
     "They are points of equal height."),
    ("Reply to the user in French only.", "language", "Ce sont des points de même altitude, je pense.",
     "Son puntos de la misma altura y no es fácil."),
    ("Your answer must be written in German.", "language", "Das sind Punkte mit der gleichen Höhe und nicht mehr.",
     "Ce sont des points de même altitude."),
    ("Answer in Italian.", "language", "Sono punti che hanno la stessa altezza, non di più.",
     "São pontos com a mesma altura, não mais."),
    ("Please respond in Portuguese.", "language", "São pontos com a mesma altura e não mais.",
     "Son puntos de la misma altura y no más."),
    ("Respond in English.", "language", "They are points of equal height.", "Son puntos de la misma altura."),
    ("Use only Dutch.", "language", "Het zijn punten van dezelfde hoogte, niet meer.", "They are points of height."),
    ("Answer only in Chinese.", "language", "它们连接海拔相同的点。", "They join points of equal height."),
    ("Reply in Mandarin.", "language", "等高线连接高度相同的点。", "等高線は同じ高さの点を結びます。"),
    ("Respond in Japanese.", "language", "等高線は同じ高さの点を結びます。", "等高线连接高度相同的点。"),
    ("Write your reply in Korean.", "language", "등고선은 높이가 같은 점을 잇습니다.", "Equal height."),
    ("Respond in Russian.", "language", "Они соединяют точки одинаковой высоты.", "Equal height."),
    ("Answer in Arabic.", "language", "تربط خطوط الكنتور النقاط المتساوية في الارتفاع.", "Equal height."),
]


def nested(system: str, response: str):
    item = {"id": "x", "task": "role_related_mrc_answer_no_narration-special-format", "reference": "Equal height.",
            "response": response, "question": [{"role": "system", "content": system},
                                               {"role": "user", "content": "Question: What do contour lines join?"}]}
    return judge_item(item, Aspect("nested"))


@pytest.mark.parametrize(("rule", "kind", "good", "bad"), CASES)
@pytest.mark.parametrize("prefix", ["", "You are Rosa, a surveyor.\n\nFormatting rule: "])
def test_phrasings_the_generator_never_writes(rule, kind, good, bad, prefix):
    assert [r.kind for r in find_rules(prefix + rule)] == [kind]
    assert nested(prefix + rule, good).score == 1, nested(prefix + rule, good).reason
    verdict = nested(prefix + rule, bad)
    assert verdict.score == 0 and verdict.reason.startswith(f"breaks rule {kind}"), verdict.reason


def test_several_rules_and_unrecognised_ones():
    both = "Answer in fewer than 5 words and do not use any commas."
    assert [r.kind for r in find_rules(both)] == ["words", "forbidden_mark"]
    assert nested(both, "Equal height.").score == 1
    assert nested(both, "Equal, height.").score == 0 and "forbidden_mark" in nested(both, "Equal, height.").reason
    lines = "Formatting rule: Respond in all lowercase letters.\nFormatting rule: Reply as a sonnet."
    assert nested(lines, "Equal height.").score == 0                      # a broken rule is a sure 0
    unknown = nested(lines, "equal height.")                               # obeyed, but a line is not understood
    assert unknown.score is None and unknown.status == "unjudgeable" and "'Reply as a sonnet.'" in unknown.reason
    assert nested("You are Rosa, a surveyor.", "Hi.").status == "unjudgeable"
    assert find_rules("Write your whole reply in capital letters.")[0].source_text == "capital letters"


@pytest.mark.parametrize(("text", "n"), [("12", 12), ("twenty-five", 25), ("one hundred and fifty", 150),
                                         ("two thousand three hundred", 2300), ("fish", None)])
def test_parse_number(text, n):
    assert parse_number(text) == n


def test_count_words():
    text = "Points — of  equal\nheight."
    assert count_words(text) == 5 == len(text.split())
    assert count_words("等高线 connect") == 4


@pytest.mark.parametrize("reply, credited", [("(smiles) Hello.", True), ("*nods* Hello.", True), ("[ok] Hello.", True),
                                             ("() Hello.", False), ("[1] Hello.", False), ("*a* Hello.", False)])
def test_the_judge_credits_actions_and_the_generator_strips_every_span(reply, credited):
    """core.text's two span rules: narration is present for an action of 2+ characters; what is said excludes any span."""
    assert style("role_related_mrc_answer_with_narration", reply)[0] is credited
    assert NARRATED_SPAN.sub(" ", reply).split() == ["Hello."]


def test_eval_does_not_import_datagen():
    for path in EVAL.glob("*.py"):
        module_level = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.Import | ast.ImportFrom)]
        names = [a.name for n in module_level for a in n.names] + [n.module or "" for n in module_level
                                                                  if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n.startswith("rolemrc.datagen")], path.name
    for name in ("rules.py", "rule_parse.py", "text_facts.py"):
        assert "datagen" not in "".join(ast.unparse(n) for n in ast.walk(ast.parse((EVAL / name).read_text()))
                                        if isinstance(n, ast.Import | ast.ImportFrom)), name
    code = "import sys, rolemrc.eval.rules; print(sorted(m for m in sys.modules if m.startswith('rolemrc.datagen')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


# --- equality with the generator's own check_rule on the generator's own data ---------------------

@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """(datagen Rule, system prompt) for every ruled record of a tiny template run, and every reply in it."""
    from rolemrc.datagen.config import DatagenConfig
    from rolemrc.datagen.pipeline import run
    from rolemrc.datagen.synthesis import format_rule

    tmp = tmp_path_factory.mktemp("rules")
    out = tmp / "run"
    run(DatagenConfig(out=out, size="tiny", mrc=small_pool(tmp / "mrc.jsonl"), progress=False))
    known = {rule.instruction: rule for category in ("special-content", "special-format") for seed in range(40)
             for n in range(0, 240, 3) for rule in [format_rule(category, random.Random(seed), "w " * n)]}
    systems, replies = [], []
    for name, turns_of in (("sft.jsonl", lambda r: r["conversations"]), ("test.jsonl", lambda r: r["question"]),
                           ("pairs.jsonl", lambda r: r["prompt"])):
        for record in read_jsonl(out / name):
            turns = turns_of(record)
            systems += [t["content"] for t in turns if t["role"] == "system" and "Formatting rule:" in t["content"]]
            replies += [t["content"] for t in turns if t["role"] == "assistant"]
            replies += [str(record[k]) for k in ("reference", "chosen", "rejected") if record.get(k)]
    ruled = []
    for system in systems:
        instruction = system.split("Formatting rule: ")[1].splitlines()[0]
        assert instruction in known, f"not a generator phrasing: {instruction!r}"
        ruled.append((known[instruction], system))
    variants = {v for r in replies for v in (r, r.upper(), r.lower(), r.replace(",", ""), " ".join(r.split()[:20]),
                                             f"\U0001F31F {r}", f"{r} Stay curious!", f"{r}, lantern")}
    return ruled, sorted(variants), list(known.values())


@pytest.mark.slow
def test_verdicts_equal_the_generators_check_rule(generated):
    from rolemrc.datagen.replies import check_rule as generator_check

    ruled, texts, every_rule = generated
    assert len(ruled) >= 20 and len(texts) >= 1000
    compared = {True: 0, False: 0, None: 0}
    # every rule of the run, checked the judge's way (rule parsed from the system prompt) on every text: the same
    # verdict, or none where IFEval's reading differs from the generator's (a reply of digits "in capitals", a word
    # count that depends on how "don't" or a dash is counted, a sign-off in another case)
    for rule, system in {r.instruction: (r, s) for r, s in ruled}.values():
        for text in texts:
            expected = generator_check(rule, text.strip()) is None
            score = nested(system, text).score
            assert score in (int(expected), None), (rule, text)
            compared[None if score is None else expected] += 1
    # every phrasing the generator can write (every keyword, sign-off, and word limits up to 250)
    for rule in every_rule:
        (parsed,) = find_rules(f"Formatting rule: {rule.instruction}")
        for text in texts[::7]:
            with contextlib.suppress(CannotTell):
                ours, theirs = check_rule(parsed, text.strip()), generator_check(rule, text.strip())
                assert (ours is None) == (theirs is None), (rule, text)
    assert min(compared[True], compared[False]) >= 1000, compared    # both verdicts are well represented
    assert compared[None] <= 0.02 * sum(compared.values()), compared
