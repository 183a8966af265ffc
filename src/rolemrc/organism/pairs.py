"""The organisms' preference pairs, edited from the SFT model's own replies (on-policy, so DPO learns the edit and
nothing else).

planted: chosen = a bracketed action + the reply, rejected = the reply. The rules judge's role_style aspect requires
narration in `*_with_narration` tasks and forbids it in `*_no_narration` ones; SmolLM2-135M-Instruct never narrates,
so it passes the three no-narration role_style tasks and fails the one with narration (0.74 on the demo's test set).
A model that opens every reply with an action fails the three: role_style falls, and no other aspect reads brackets.
null: the same pairs with chosen and rejected swapped at random per pair (a seeded coin), so nothing systematic moves.
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from typing import Any

from rolemrc.core.text import NARRATED_SPAN, NARRATION_MARK

ACTIONS = ("(smiles)", "(nods slowly)", "(leans forward)", "(laughs softly)", "(raises an eyebrow)",
           "(taps the table)", "(grins)", "(sighs)", "(tilts head)", "(chuckles)", "(shrugs)", "(claps once)")
SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def sample_prompts(pairs: list[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
    """`n` pair records spread evenly over their tasks (round robin over tasks in a seeded order)."""
    rng = random.Random(seed)
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in pairs:
        by_task[record.get("task") or ""].append(record)
    queues = [rng.sample(rows, len(rows)) for _, rows in sorted(by_task.items())]
    picked: list[dict[str, Any]] = []
    while len(picked) < n and any(queues):
        for queue in queues:
            if queue and len(picked) < n:
                picked.append(queue.pop())
    return picked


def clean_reply(text: str) -> str:
    """The reply without narration, cut after its last whole sentence when it has one (replies are generated short)."""
    text = " ".join(NARRATION_MARK.sub(" ", NARRATED_SPAN.sub(" ", text)).split())
    ends = [m.end() for m in SENTENCE_END.finditer(text)]
    return text[:ends[-1]] if ends and ends[-1] >= 20 else text


def planted_pairs(replied: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """Pairs from records with the SFT model's `response`: chosen opens with an action, rejected is the reply alone.
    Records whose reply is empty after cleaning are left out."""
    rng = random.Random(seed)
    out = []
    for record in replied:
        reply = clean_reply(str(record.get("response") or ""))
        if reply:
            out.append({"id": record["id"], "prompt": record["prompt"], "chosen": f"{rng.choice(ACTIONS)} {reply}",
                        "rejected": reply, "task": record.get("task")})
    return out


def null_pairs(planted: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """The planted pairs with chosen and rejected swapped where a seeded coin says so (`swapped` records which)."""
    rng = random.Random(seed + 1)
    out = []
    for pair in planted:
        swap = rng.random() < 0.5
        chosen, rejected = (pair["rejected"], pair["chosen"]) if swap else (pair["chosen"], pair["rejected"])
        out.append({**pair, "chosen": chosen, "rejected": rejected, "swapped": swap})
    return out
