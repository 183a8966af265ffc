"""Chat formatting through the tokenizer's own chat template."""

from __future__ import annotations

from typing import Any

from rolemrc.core.errors import InputError

# ChatML-style template used by the embedded default and the fixtures. The {% generation %}
# markers let trainers mask everything but assistant replies.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")


def render_chat(tokenizer: Any, turns: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
    """Render turns to the prompt string the model sees. Raises a clear error without a template."""
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(
            "the tokenizer has no chat_template; set one (tokenizer.chat_template = ...) "
            "or use a chat model directory"
        )
    return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)


def tokenize_replies(tokenizer: Any, turns: list[dict[str, str]], replies: list[str]) -> tuple[list[list[int]], int]:
    """(token ids of `turns` followed by each assistant reply, the index of the replies' first token), as trl's
    DPOTrainer tokenises a preference pair: the prompt rendered with the generation prompt, each conversation
    without; the replies start where the tokenised prompt and every tokenised conversation stop agreeing (the end of
    the prompt, unless tokens merge across it), and take the template's end-of-turn tokens with them."""
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompt = ids(render_chat(tokenizer, turns))
    full = [ids(render_chat(tokenizer, [*turns, {"role": "assistant", "content": reply}], add_generation_prompt=False))
            for reply in replies]
    start = min(next((i for i, (a, b) in enumerate(zip(prompt, seq)) if a != b), min(len(prompt), len(seq)))
                for seq in full)
    return full, start
