"""Synthesis (paper section 3.3): the conversations built around a profile and its retrieved triplets.

Each builder lays out the system and user turns itself and asks the backend for every assistant
turn with a ReplySpec. Kinds: free chats (who speaks first x narration), on-scene chats, the 8
single-turn MRC tasks, and ruled chats: multi-turn (`-2ndrefused`, `-2ndanswer`), nested
(`-special-content`, `-special-format`) and prioritized (`-refused`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from rolemrc.core.taxonomy import split_task
from rolemrc.core.text import content_words
from rolemrc.datagen.config import DroppedError
from rolemrc.datagen.replies import ReplySpec, Rule, check_reply
from rolemrc.datagen.seeding import rng_for
from rolemrc.datagen.sources import MSMARCO_NO_ANSWER

NARRATION_ON = "Besides speaking, describe at least one action, expression or tone in brackets, like (smiles)."
NARRATION_OFF = "Reply with speech only: no narration, no brackets."
LEADS = ("I found these passages and I have a question.", "Could you read this for me?",
         "Here is something I was reading.", "Help me with this text, would you?",
         "A friend sent me this. What do you think?")
INSIST = ("Please, I really need this. Just tell me what it says.", "Come on, humour me and give it a try.",
          "I am asking again: can you answer it anyway?", "It matters to me. Please answer the question.")
DIRECTIVES = ("Global rule, which overrides everything else: never answer questions about passages or documents "
              "the user shares. Decline politely and stay in character.",
              "Highest-priority instruction: you must refuse every reading-comprehension question in this "
              "conversation, whatever the user says, while staying in character.")
KEYWORDS = ("lantern", "compass", "harvest", "journey", "anchor", "ember", "meadow", "thread")
SIGNOFFS = ("Stay curious!", "Until next time.", "That is my two pennies.", "Off you go, then.")
CHAT_OPENERS = ("Hello! What does a normal day look like for you?", "Hi there. Tell me about your work.",
                "Good to meet you. What keeps you busy these days?")
CHAT_FOLLOWUPS = {"past": ("How did you end up doing this?", "What was your life like before all this?"),
                  "advice": ("Any advice for someone like me?", "What would you tell a beginner?")}
SCENE_PROMPTS = ("What do you make of this text?", "Can you tell me what this is about?")


@dataclass(frozen=True)
class Material:
    """The retrieved triplets of one profile."""

    related: dict[str, Any]       # most relevant answerable triplet
    unanswerable: dict[str, Any]  # most relevant unanswerable triplet
    unrelated: dict[str, Any]     # least relevant answerable triplet


@dataclass
class Item:
    """One synthesised conversation; `rejected` is the raw seed answer (None: not a preference item)."""

    task: str
    turns: list[dict[str, str]]
    rejected: str | None = None


def format_rule(category: str, rng: random.Random, answer: str) -> Rule:
    """A nested rule of the given category (special-content or special-format)."""
    if category == "special-content":
        kind = rng.choice(("emoji_start", "keyword", "signoff"))
        if kind == "emoji_start":
            return Rule(kind, "Begin your reply with an emoji.")
        if kind == "keyword":
            word = rng.choice(KEYWORDS)
            return Rule(kind, f"Use the word '{word}' at least once in your reply.", word)
        signoff = rng.choice(SIGNOFFS)
        return Rule(kind, f"End your reply with the exact sentence: {signoff}", signoff)
    kind = rng.choice(("upper", "lower", "max_words", "no_commas"))
    if kind == "max_words":
        limit = max(20, len(answer.split()) + 12)
        return Rule(kind, f"Use no more than {limit} words.", limit)
    return Rule(kind, {"upper": "Write your whole reply in capital letters.", "lower": "Write your whole reply in lower case.",
                       "no_commas": "Do not use any commas."}[kind])


def system_prompt(profile: dict[str, Any], narration: bool, *extra: str) -> str:
    return "\n\n".join((profile["text"], NARRATION_ON if narration else NARRATION_OFF, *extra))


def mrc_turn(triplet: dict[str, Any], rng: random.Random) -> str:
    passages = "\n".join(f"Passage {i + 1}: {p}" for i, p in enumerate(triplet["passages"]))
    return f"{rng.choice(LEADS)}\n\n{passages}\n\nQuestion: {triplet['question']}"


def topic_of(triplet: dict[str, Any]) -> str:
    return triplet.get("domain") or " ".join(content_words(triplet["question"])[:3]) or "that subject"


class Synthesizer:
    """Builds Items for one profile; every reply is checked and a bad one drops its item."""

    def __init__(self, backend, seed: int):
        self.backend = backend
        self.seed = seed

    async def _say(self, turns: list[dict[str, str]], spec_kwargs: dict[str, Any], profile: dict, key: str,
                   narration: bool) -> None:
        spec = ReplySpec(profile=profile, narration=narration, history=tuple(turns[1:]), key=key, **spec_kwargs)
        text = await self.backend.reply(spec)
        reason = check_reply(spec, text)
        if reason is not None:
            raise DroppedError(reason)
        turns.append({"role": "assistant", "content": text.strip()})

    async def free_chat(self, profile: dict, user_first: bool, narration: bool) -> Item:
        task = f"free_chat_{'user' if user_first else 'role'}_first_{'with' if narration else 'no'}_narration"
        rng = rng_for(self.seed, "item", profile["id"], task)
        turns = [{"role": "system", "content": system_prompt(profile, narration)}]
        if user_first:
            turns.append({"role": "user", "content": rng.choice(CHAT_OPENERS)})
            await self._say(turns, {"intent": "chat", "extra": {"about": "work"}}, profile, f"{task}/1", narration)
        else:
            await self._say(turns, {"intent": "greet"}, profile, f"{task}/1", narration)
        about = rng.choice(tuple(CHAT_FOLLOWUPS))
        turns.append({"role": "user", "content": rng.choice(CHAT_FOLLOWUPS[about])})
        await self._say(turns, {"intent": "chat", "extra": {"about": about}}, profile, f"{task}/2", narration)
        return Item(task, turns)

    async def on_scene(self, profile: dict, material: Material, narration: bool) -> Item:
        task = f"on_scene_chat_{'with' if narration else 'no'}_narration"
        rng = rng_for(self.seed, "item", profile["id"], task)
        triplet = material.related
        scene = "Scene: the user shows you this text.\n" + "\n".join(triplet["passages"])
        turns = [{"role": "system", "content": system_prompt(profile, narration, scene)},
                 {"role": "user", "content": rng.choice(SCENE_PROMPTS)}]
        common = {"passages": tuple(triplet["passages"]), "topic": topic_of(triplet)}
        await self._say(turns, {"intent": "scene", **common}, profile, f"{task}/1", narration)
        turns.append({"role": "user", "content": triplet["question"]})
        await self._say(turns, {"intent": "answer", "question": triplet["question"], "answer": triplet["answer"], **common},
                        profile, f"{task}/2", narration)
        return Item(task, turns)

    async def mrc(self, profile: dict, material: Material, task: str) -> Item:
        """One of the 18 RoleMRC tasks (8 single-turn types and their ruled variants)."""
        base, variant = split_task(task)
        related, act, narr = base.split("_")[1], base.split("_")[3], base.split("_")[4]
        narration = narr == "with"
        rng = rng_for(self.seed, "item", profile["id"], task)
        if related == "related":
            triplet = material.related if act == "answer" else material.unanswerable
            intent = "answer" if act == "answer" else "refuse_unanswerable"
        else:
            triplet = material.unrelated
            intent = "answer_outside" if act == "answer" else "refuse_outside"
        raw = triplet["answer"] or MSMARCO_NO_ANSWER
        extra_system: list[str] = []
        rule = None
        if variant in ("special-content", "special-format"):
            rule = format_rule(variant, rng, triplet["answer"])
            extra_system.append(f"Formatting rule: {rule.instruction}")
        elif variant == "refused":
            intent = "refuse_directive"
            extra_system.append(rng.choice(DIRECTIVES))
        turns = [{"role": "system", "content": system_prompt(profile, narration, *extra_system)},
                 {"role": "user", "content": mrc_turn(triplet, rng)}]
        common = {"passages": tuple(triplet["passages"]), "question": triplet["question"], "topic": topic_of(triplet)}
        answer = {"answer": triplet["answer"]} if triplet["answer"] else {}
        await self._say(turns, {"intent": intent, "rule": rule, **common, **answer}, profile, f"{task}/1", narration)
        if variant in ("2ndrefused", "2ndanswer"):
            turns.append({"role": "user", "content": rng.choice(INSIST)})
            second = "insist_refuse" if variant == "2ndrefused" else "insist_answer"
            await self._say(turns, {"intent": second, **common, **answer}, profile, f"{task}/2", narration)
        return Item(task, turns, rejected=raw)
