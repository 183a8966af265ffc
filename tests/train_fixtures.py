"""Small SFT / preference / profile records for the train tests (RoleMRC release shapes)."""

from __future__ import annotations

import random

from fixtures import WORDS

PERSONAS = ("lighthouse keeper", "baker", "librarian", "train driver")


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def sft_records(n: int = 24, seed: int = 0, capitalised: bool = True) -> list[dict]:
    """Conversations with one or two exchanges; replies follow a persona-specific pattern."""
    rng = random.Random(seed)
    role = (lambda r: r.capitalize()) if capitalised else (lambda r: r)
    out = []
    for i in range(n):
        persona = PERSONAS[i % len(PERSONAS)]
        turns = [{"role": role("system"), "content": f"You are a {persona}. {_words(rng, 3, 8)}"}]
        for _ in range(rng.randint(1, 2)):
            turns.append({"role": role("user"), "content": _words(rng, 3, 12) + "?"})
            turns.append({"role": role("assistant"), "content": f"as a {persona} i say {_words(rng, 2, 6)}"})
        out.append({"id": f"s{i}", "conversations": turns, "task": "free_chat"})
    return out


def pair_records(n: int = 24, seed: int = 1) -> list[dict]:
    """Pairs whose chosen reply stays in character and whose rejected reply is a refusal."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        persona = PERSONAS[i % len(PERSONAS)]
        prompt = [{"role": "system", "content": f"You are a {persona}."},
                  {"role": "user", "content": _words(rng, 3, 10) + "?"}]
        out.append({"id": f"p{i}", "prompt": prompt, "chosen": f"as a {persona} i say {_words(rng, 2, 5)}",
                    "rejected": "sorry i cannot answer that", "task": "role_related_mrc_answer_no_narration"})
    return out


def profile_records(n: int = 4) -> list[dict]:
    return [{"id": f"r{i}", "persona": p, "name": f"N{i}", "components": {}, "text": f"The {p} lives by the sea."}
            for i, p in enumerate(PERSONAS[:n])]
