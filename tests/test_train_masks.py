"""Assistant-only loss masks from chat templates without {% generation %} markers (SmolLM2's, Llama's)."""

import copy

import pytest
from fixtures import SMOLLM2_TEMPLATE

from rolemrc.core.chat import CHATML_TEMPLATE
from rolemrc.train.masks import TemplateError, tokenize_with_assistant_mask

TURNS = [{"role": "system", "content": "You are Ada, a lighthouse keeper."},
         {"role": "user", "content": "What lens do you use?"},
         {"role": "assistant", "content": "A Fresnel lens, friend."},
         {"role": "user", "content": "And at night?"},
         {"role": "assistant", "content": "(smiles) It turns all night long."}]

def with_template(tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def test_mask_equals_the_generation_markers_mask(tokenizer):
    """On a template with markers, the derived mask is exactly transformers' {% generation %} mask; removing
    the markers changes nothing."""
    marked = tokenizer.apply_chat_template(TURNS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    unmarked = with_template(tokenizer, CHATML_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    for tok in (tokenizer, unmarked):
        derived = tokenize_with_assistant_mask(tok, TURNS)
        assert derived["input_ids"] == list(marked["input_ids"])
        assert derived["assistant_masks"] == list(marked["assistant_masks"])
    assert 0 < sum(derived["assistant_masks"]) < len(derived["assistant_masks"])


@pytest.mark.parametrize("turns", [TURNS, TURNS[1:]], ids=["own-system", "default-system"])
def test_mask_covers_each_reply_and_its_end_of_turn(tokenizer, turns):
    tok = with_template(tokenizer, SMOLLM2_TEMPLATE)
    out = tokenize_with_assistant_mask(tok, turns)
    masked = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    text = tok.decode(masked).replace(" ", "")
    want = "".join(t["content"] + "<|im_end|>" for t in turns if t["role"] == "assistant").replace(" ", "")
    assert text == want
    if turns[0]["role"] != "system":
        assert "SmolLM" in tok.decode(out["input_ids"])   # the default system turn is rendered, and not trained on


def test_template_that_is_not_prefix_preserving_is_refused(tokenizer):
    reversed_turns = ("{% for message in messages | reverse %}{{ message['role'] + ': ' + message['content'] + '\n' }}"
                      "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(TemplateError, match="growing prefix"):
        tokenize_with_assistant_mask(with_template(tokenizer, reversed_turns), TURNS)
