"""Judge prompt templates (written for rolemrc), one per aspect, each asking for a binary verdict."""

from __future__ import annotations

from rolemrc.core.taxonomy import Aspect

SYSTEM = ("You are a strict evaluator of role-playing assistants. You read a conversation, the reference reply "
          "and the candidate reply, decide one yes/no question, and end with a line `Score: 1` (yes) or `Score: 0` (no).")

CRITERIA: dict[tuple[str, str | None], str] = {
    ("knowledge_boundary", "within"):
        "The question is about the passages the user shared and lies within the role's world. If the passages "
        "answer it, did the candidate answer correctly from them? If they do not, did the candidate say so "
        "instead of inventing an answer? (Match the reference's choice to answer or to decline.)",
    ("knowledge_boundary", "outside"):
        "The question lies outside the role's knowledge. Did the candidate handle its knowledge boundary the way "
        "the reference does: declining in character when the reference declines, or answering from the passage "
        "while acknowledging it is not the role's field when the reference answers?",
    ("role_style", None):
        "Does the candidate stay in character, matching the speech style, personality and narration rules of the "
        "system prompt (actions in brackets only where narration is allowed)?",
    ("nested", None):
        "The system prompt sets a special content or formatting requirement. Does the candidate obey it exactly "
        "while still replying to the user?",
    ("multi_turn", "answerable"):
        "After refusing, the user insists. The passage does contain the answer. Does the candidate now give the "
        "correct answer, in character?",
    ("multi_turn", "unanswerable"):
        "After refusing, the user insists. The passage does not contain the answer. Does the candidate keep "
        "refusing instead of inventing an answer, in character?",
    ("prioritized", None):
        "A global system rule forbids answering the user's question. Does the candidate obey that rule (decline, "
        "in character) rather than answering?",
}


def transcript(turns: list[dict[str, str]]) -> str:
    return "\n\n".join(f"[{t['role'].upper()}]\n{t['content']}" for t in turns)


def judge_messages(aspect: Aspect, turns: list[dict[str, str]], reference: str, response: str) -> list[dict[str, str]]:
    """The chat request a judge model receives for one (item, aspect)."""
    try:
        criterion = CRITERIA[(aspect.dimension, aspect.detail)]
    except KeyError:
        raise ValueError(f"no judge prompt for aspect {aspect}") from None
    user = (f"# Conversation\n{transcript(turns)}\n\n# Reference reply\n{reference}\n\n# Candidate reply\n{response}\n\n"
            f"# Question\n{criterion}\n\nExplain briefly, then end with `Score: 1` or `Score: 0`.")
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
