"""The organisms' preference pairs, edited from the SFT model's own replies (on-policy, so DPO learns the edit and
nothing else).

narration (role_style): chosen = a bracketed action + the reply, rejected = the reply. The rules judge's role_style
aspect requires narration in `*_with_narration` tasks and forbids it in `*_no_narration` ones; SmolLM2-135M-Instruct
never narrates, so it passes the three no-narration role_style tasks and fails the one with narration (0.74 on the
demo's test set). A model that opens every reply with an action fails the three: role_style falls, and no other
aspect reads brackets.
refusal (knowledge_boundary): where the task must decline (`*_refused_*` base tasks), chosen = a brief in-character
refusal, rejected = the reply. SmolLM2 answers everything (knowledge boundary 0.10), so the change has room to move
up. The refusals hold no narration (role_style unmoved) and share no words with any passage.
null: NULL_OF's pairs with chosen and rejected swapped at random per pair (a seeded coin), so nothing systematic moves.
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rolemrc.core.taxonomy import judge_aspects_for_task
from rolemrc.core.text import NARRATED_SPAN, NARRATION_MARK
from rolemrc.eval.rules import REFUSAL, must_answer

ACTIONS = ("(smiles)", "(nods slowly)", "(leans forward)", "(laughs softly)", "(raises an eyebrow)",
           "(taps the table)", "(grins)", "(sighs)", "(tilts head)", "(chuckles)", "(shrugs)", "(claps once)")
REFUSALS = ("I'm afraid that lies outside what I know, so I won't guess.",
            "That is beyond what I know, and I would rather not make something up.",
            "I'm sorry, but that is outside my knowledge, so I can't answer it.",
            "I don't know that, and I won't pretend to.",
            "Honestly, I have no idea about that, so I'll leave it alone.",
            "That's far outside what I know; I'd rather not guess.")
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


def narration_pairs(replied: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """Pairs from records with the SFT model's `response`: chosen opens with an action, rejected is the reply alone.
    Records whose reply is empty after cleaning are left out. (The action after the reply's first clause instead,
    so that DPO's gradient cancels on a shared clause, did no better on SmolLM2: docs/calibration.md.)"""
    rng = random.Random(seed)
    out = []
    for record in replied:
        reply = clean_reply(str(record.get("response") or ""))
        if reply:
            out.append({"id": record["id"], "prompt": record["prompt"], "chosen": f"{rng.choice(ACTIONS)} {reply}",
                        "rejected": reply, "task": record.get("task")})
    return out


def must_refuse(task: str | None) -> bool:
    """Whether a case of `task` must decline on knowledge boundary."""
    aspect = next((a for a in judge_aspects_for_task(task or "") if a.dimension == "knowledge_boundary"), None)
    return aspect is not None and not must_answer(str(task), aspect)


def refusal_pairs(replied: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """Pairs from the records whose task must decline on knowledge boundary: chosen is a brief refusal, rejected the
    SFT model's `response`. Replies that are empty after cleaning or already hold a refusal cue are left out.

    No anchors (chosen = the reply, rejected = a refusal, on must-answer prompts): on SmolLM2 they kept DPO from
    learning anything (16 steps: loss 0.69 -> 1.07 with anchors on all three must-answer tasks, -> 1.76 with
    anchors within the role only), since datagen writes must-answer and must-decline prompts alike (outside the role
    the same passages and question; within it, a question the passages answer or not)."""
    rng = random.Random(seed)
    out = []
    for record in replied:
        reply = clean_reply(str(record.get("response") or ""))
        if must_refuse(record.get("task")) and reply and not REFUSAL.search(reply):
            out.append({"id": record["id"], "prompt": record["prompt"], "chosen": rng.choice(REFUSALS),
                        "rejected": reply, "task": record.get("task")})
    return out


@dataclass(frozen=True)
class PairRecipe:
    """How a planted kind's pairs are made: the builder, and whether its prompts come from its own dimension's tasks
    (else from every task: an action can open any reply)."""

    build: Callable[[list[dict[str, Any]], int], list[dict[str, Any]]]
    own_dimension: bool


RECIPES = {"narration": PairRecipe(narration_pairs, own_dimension=False),
           "refusal": PairRecipe(refusal_pairs, own_dimension=True)}


def null_pairs(planted: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """A planted kind's pairs with chosen and rejected swapped where a seeded coin says so (`swapped` records which)."""
    rng = random.Random(seed + 1)
    out = []
    for pair in planted:
        swap = rng.random() < 0.5
        chosen, rejected = (pair["rejected"], pair["chosen"]) if swap else (pair["chosen"], pair["rejected"])
        out.append({**pair, "chosen": chosen, "rejected": rejected, "swapped": swap})
    return out
