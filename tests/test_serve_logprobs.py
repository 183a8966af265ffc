"""Token log-probabilities over real HTTP with the real `openai` client: chat (whole and streamed), legacy
completions with echo, checked against an independent forward of the HF model; the paper's factor keeps tokens and
moves logprobs by at most float32 rounding, a real factor moves them; unsupported parameters refused with 400."""

import httpx
import openai
import pytest
import torch

from rolemrc.core.chat import render_chat
from rolemrc.core.modeling import load_model
from rolemrc.intervene import Restraint
from rolemrc.serve.launch import running_server

CHAT = [{"role": "user", "content": "the storms quarter the old"}]
PROMPT = "the keeper of the"
EVERY = list(range(96))


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-logprobs")
    Restraint(name="faint", hook="mlp.act", factor=1 - 1e-6, units={0: EVERY, 1: EVERY}).save(root / "faint.yaml")
    Restraint(name="half", hook="mlp.act", factor=0.5, units={0: EVERY, 1: EVERY}).save(root / "half.yaml")
    config = {"models": {"tiny": {"path": str(model_dirs["llama"])}},
              "restraints": {"faint": "faint.yaml", "half": "half.yaml"},
              "max_new_tokens": 64, "default_max_tokens": 8, "db": "ab.sqlite"}
    with running_server(config, workdir=root) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def hf(model_dirs):
    return load_model(model_dirs["llama"], dtype="float32", device="cpu")


def greedy_reference(hf, ids: list[int], steps: int) -> list[tuple[int, torch.Tensor]]:
    """Greedy continuation by full forwards (no cache): (token, log-softmax row) per step."""
    model, _ = hf
    out = []
    with torch.inference_mode():
        for _ in range(steps):
            logp = model(input_ids=torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
            token = int(logp.argmax())
            out.append((token, logp))
            ids = [*ids, token]
    return out


def chat(client, model="tiny", stream=False, **extra):
    return client.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0, logprobs=True,
                                          top_logprobs=3, stream=stream, extra_body={"ignore_eos": True, **extra})


def test_chat_logprobs_match_an_independent_forward(client, hf):
    out = chat(client)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 10
    _, tokenizer = hf
    prompt = tokenizer(render_chat(tokenizer, CHAT), add_special_tokens=False)["input_ids"]
    for entry, (token, logp) in zip(content, greedy_reference(hf, prompt, 10)):
        assert entry.token == tokenizer.decode([token]) and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(float(logp[token]), abs=1e-4)
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].token == entry.token and tops[0] == pytest.approx(entry.logprob, abs=1e-6)
    assert "".join(e.token for e in content) == out.choices[0].message.content


def test_streamed_logprobs_concatenate_to_the_whole(client):
    whole = chat(client).choices[0].logprobs.content
    chunks = list(chat(client, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole]
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_with_echo(client, hf):
    model, tokenizer = hf
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, echo=True,
                                    extra_body={"ignore_eos": True})
    choice, lp = out.choices[0], out.choices[0].logprobs
    prompt = tokenizer(PROMPT)["input_ids"]
    assert choice.text.startswith(PROMPT) and len(lp.tokens) == len(prompt) + 5 == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # the chosen token and the 2 best (as vLLM and OpenAI)
    assert all(len(top) <= 3 and token in top for top, token in zip(lp.top_logprobs[1:], lp.tokens[1:]))
    assert lp.text_offset == sorted(lp.text_offset)
    with torch.inference_mode():
        logp = model(input_ids=torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    expected = [float(logp[j, prompt[j + 1]]) for j in range(len(prompt) - 1)]
    expected += [float(row[t]) for t, row in greedy_reference(hf, prompt, 5)]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    streamed = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                              echo=True, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in pieces for t in p.tokens] == lp.tokens
    assert [o for p in pieces for o in p.text_offset] == lp.text_offset
    bare = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0)
    assert len(bare.choices[0].logprobs.tokens) == bare.usage.completion_tokens
    assert not bare.choices[0].text.startswith(PROMPT) or bare.choices[0].text == ""


def test_the_paper_factor_keeps_tokens_and_a_real_factor_moves_logprobs(client):
    """x(1 - 1e-6) moves a logprob by float32 rounding at most: 0 on some BLAS paths, ~1e-7 on others, so only the
    bound is asserted; x0.5 on the same units is served through the same path and moves them for certain."""
    plain = chat(client).choices[0].logprobs.content
    faint, half = (chat(client, model=f"tiny+{name}").choices[0].logprobs.content for name in ("faint", "half"))
    assert [e.token for e in plain] == [e.token for e in faint]
    shift = lambda other: max(abs(a.logprob - b.logprob) for a, b in zip(plain, other))  # noqa: E731
    print(f"largest logprob shift: {shift(faint):.3g} under x(1 - 1e-6), {shift(half):.3g} under x0.5")
    assert shift(faint) < 1e-4 < 1e-2 < shift(half)


@pytest.mark.parametrize(("endpoint", "field", "value"), [
    ("chat/completions", "logit_bias", {"5": 10}), ("chat/completions", "presence_penalty", 0.5),
    ("chat/completions", "frequency_penalty", -1.0), ("chat/completions", "tools", [{"type": "function"}]),
    ("chat/completions", "response_format", {"type": "json_object"}), ("chat/completions", "top_logprobs", 2),
    ("chat/completions", "response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    ("completions", "best_of", 3), ("completions", "suffix", "end"), ("completions", "logit_bias", {"1": 1}),
])
def test_unsupported_parameters_are_refused(server, endpoint, field, value):
    body = {"model": "tiny", "max_tokens": 2, field: value}
    body |= {"messages": CHAT} if endpoint.startswith("chat") else {"prompt": PROMPT}
    response = httpx.post(f"{server.base_url}/v1/{endpoint}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("value", [{"type": "json_schema"}, {"type": "text", "json_schema": {"schema": {}}},
                                   {"type": "xml"}])
def test_malformed_response_format_is_invalid(server, value):
    body = {"model": "tiny", "max_tokens": 2, "messages": CHAT, "response_format": value}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body)
    assert response.status_code == 422 and response.json()["error"]["param"].startswith("response_format"), response.text


def test_no_op_values_of_unsupported_parameters_pass(server):
    body = {"model": "tiny", "max_tokens": 2, "messages": CHAT, "presence_penalty": 0, "logit_bias": {},
            "response_format": {"type": "text"}, "tool_choice": "none", "tools": []}
    assert httpx.post(f"{server.base_url}/v1/chat/completions", json=body).status_code == 200
