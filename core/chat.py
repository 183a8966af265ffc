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
