"""Assistant-only loss masks derived from the model's own chat template.

trl masks assistant turns with `{% generation %}` markers, which most released templates (SmolLM2's, Llama's)
lack. Any template that renders a conversation as a prefix-preserving concatenation of turns gives the same
mask without them: an assistant turn's text is what rendering turns[:i+1] adds to rendering turns[:i] with
the generation prompt, and its tokens are those starting inside that span (end-of-turn token included, so
the model learns to stop; whitespace after it is not trained on, as with ChatML's markers).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rolemrc.core.errors import RolemrcError


class TemplateError(RolemrcError, ValueError):
    """The chat template cannot give assistant masks (not prefix-preserving, or no fast tokenizer)."""


def assistant_spans(tokenizer: Any, turns: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the character span of each assistant turn in it)."""
    render = lambda part, gen: tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    text = render(turns, False)
    spans = []
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        before = render(turns[:i], True) if i else ""
        through = render(turns[: i + 1], False)
        if not (through.startswith(before) and text.startswith(through)):
            raise TemplateError(
                "the chat template does not render conversations as a growing prefix (turn "
                f"{i}: rendering the first {i + 1} turns is not a prefix of rendering them all), so assistant "
                "turns cannot be located; give the tokenizer a template that does, or set assistant_only_loss=false")
        spans.append((len(before), len(through.rstrip())))  # the newline after the end-of-turn token is not a reply
    return text, spans


def tokenize_with_assistant_mask(tokenizer: Any, turns: list[dict[str, str]]) -> dict[str, list[int]]:
    """trl's pre-tokenized SFT example: `input_ids` and `assistant_masks` (1 on assistant-turn tokens)."""
    if not getattr(tokenizer, "is_fast", False):
        raise TemplateError("assistant masks need a fast tokenizer (character offsets); "
                            f"{type(tokenizer).__name__} is not one")
    text, spans = assistant_spans(tokenizer, turns)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = np.array([start for start, _ in encoded["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(starts), dtype=bool)
    for lo, hi in spans:
        mask |= (starts >= lo) & (starts < hi)
    return {"input_ids": list(encoded["input_ids"]), "assistant_masks": mask.astype(np.int64).tolist()}
