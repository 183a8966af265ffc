"""Completions as the API defines them, over real HTTP on the transformers engine: every prompt form (a string,
strings, token ids, token-id lists), n choices (indexed p * n + k, streamed too, seeds seed + k), usage summed,
and lm-eval's log-likelihood request (token-id prompts, max_tokens 1, echo, logprobs 1) checked against an
independent forward of the model, including prompts whose greedy next token is EOS."""

import json

import httpx
import openai
import pytest
import torch
from fixtures import STOPS_ON_EOS
from transformers import AutoModelForCausalLM

from rolemrc.serve.launch import running_server

TEXTS = ["the keeper of the", "a baker in the old"]


@pytest.fixture(scope="module")
def server(peaked_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-completions")
    config = {"models": {"tiny": {"path": str(peaked_model)}}, "max_new_tokens": 64, "default_max_tokens": 8,
              "db": "ab.sqlite", "allow_no_auth": True}   # no keys: allow_no_auth makes every caller admin
    with running_server(config, workdir=root) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model(peaked_model):
    return AutoModelForCausalLM.from_pretrained(peaked_model, dtype=torch.float32).eval()


def complete(server, **body) -> dict:
    response = httpx.post(f"{server.base_url}/v1/completions", json={"model": "tiny", **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def texts(out: dict) -> list[str]:
    assert [c["index"] for c in out["choices"]] == list(range(len(out["choices"])))
    return [c["text"] for c in out["choices"]]


def test_every_prompt_form_gives_one_choice_per_prompt(server, tokenizer):
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    singles = [complete(server, prompt=t, max_tokens=6, temperature=0) for t in TEXTS]
    assert texts(complete(server, prompt=ids[0], max_tokens=6, temperature=0)) == texts(singles[0])
    for form in (TEXTS, ids):
        out = complete(server, prompt=form, max_tokens=6, temperature=0)
        assert texts(out) == [texts(s)[0] for s in singles]
        for key in ("prompt_tokens", "completion_tokens"):
            assert out["usage"][key] == sum(s["usage"][key] for s in singles)
    assert out["usage"]["prompt_tokens"] == sum(map(len, ids))


def test_n_choices_greedy_and_seeded(server, client):
    greedy = complete(server, prompt=TEXTS[0], max_tokens=6, temperature=0, n=3)
    assert len(set(texts(greedy))) == 1 and len(greedy["choices"]) == 3
    assert greedy["usage"]["prompt_tokens"] == complete(server, prompt=TEXTS[0], max_tokens=6)["usage"]["prompt_tokens"]
    sampled = {"max_tokens": 12, "temperature": 2.0, "ignore_eos": True}
    out = complete(server, prompt=TEXTS, n=3, seed=7, **sampled)
    assert texts(out) == texts(complete(server, prompt=TEXTS, n=3, seed=7, **sampled))   # reproducible
    for p, prompt in enumerate(TEXTS):   # choice p * n + k is prompt p sampled with seed 7 + k
        choices = [texts(complete(server, prompt=prompt, seed=7 + k, **sampled))[0] for k in range(3)]
        assert texts(out)[3 * p:3 * p + 3] == choices
        assert len(set(choices)) > 1
    assert out["usage"]["completion_tokens"] == 6 * 12
    chat = client.chat.completions.create(model="tiny", messages=STOPS_ON_EOS, n=2, seed=3, max_tokens=8,
                                          temperature=2.0)
    assert [c.index for c in chat.choices] == [0, 1]
    second = client.chat.completions.create(model="tiny", messages=STOPS_ON_EOS, seed=4, max_tokens=8, temperature=2.0)
    assert chat.choices[1].message.content == second.choices[0].message.content


def test_streamed_choices_carry_their_index(server, client):
    body = {"prompt": TEXTS, "n": 2, "seed": 11, "max_tokens": 8, "temperature": 1.5, "logprobs": 1, "echo": True}
    whole = complete(server, **body)
    streamed: dict[int, list[dict]] = {}
    usage = None
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60,
                      json={"model": "tiny", "stream": True, "stream_options": {"include_usage": True}, **body}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    streamed.setdefault(choice["index"], []).append(choice)
    assert sorted(streamed) == [0, 1, 2, 3] and usage == whole["usage"]
    for choice in whole["choices"]:
        parts = streamed[choice["index"]]
        assert "".join(c["text"] for c in parts) == choice["text"] and choice["text"].startswith(TEXTS[choice["index"] // 2])
        assert [t for c in parts if c.get("logprobs") for t in c["logprobs"]["tokens"]] == choice["logprobs"]["tokens"]
        assert [o for c in parts if c.get("logprobs") for o in c["logprobs"]["text_offset"]] == choice["logprobs"]["text_offset"]
        assert parts[-1]["finish_reason"] == choice["finish_reason"]
    chunks = list(client.chat.completions.create(model="tiny", messages=STOPS_ON_EOS, n=2, max_tokens=4, temperature=0,
                                                 stream=True))
    assert [c.choices[0].index for c in chunks[:2]] == [0, 1] and chunks[0].choices[0].delta.role == "assistant"
    by_index = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in (0, 1)]
    assert by_index[0] == by_index[1] != ""


def test_loglikelihood_requests_match_an_independent_forward(server, model, tokenizer, eos_split_prompts):
    """lm-eval's `local-completions` request: it sums token_logprobs[ctxlen:-1], so the generated token (an EOS
    too) must be listed after the prompt's."""
    prompts = eos_split_prompts["eos"] + eos_split_prompts["other"]
    ctxlen = 3
    out = complete(server, prompt=prompts, max_tokens=1, echo=True, logprobs=1, temperature=0, seed=1234)
    assert out["usage"]["completion_tokens"] == len(prompts)
    with torch.inference_mode():
        logp = model(input_ids=torch.tensor(prompts)).logits.float().log_softmax(-1)
    for i, (prompt, choice) in enumerate(zip(prompts, out["choices"])):
        lp = choice["logprobs"]
        assert choice["index"] == i and len(lp["tokens"]) == len(prompt) + 1
        expected = sum(float(logp[i, j - 1, prompt[j]]) for j in range(ctxlen, len(prompt)))
        assert sum(lp["token_logprobs"][ctxlen:-1]) == pytest.approx(expected, abs=1e-4)
        greedy = int(logp[i, -1].argmax())
        assert lp["token_logprobs"][-1] == pytest.approx(float(logp[i, -1, greedy]), abs=1e-4)
        assert max(lp["top_logprobs"][-1].values()) == pytest.approx(lp["token_logprobs"][-1], abs=1e-6)
        decoded = tokenizer.decode(prompt, clean_up_tokenization_spaces=False)
        if prompt in eos_split_prompts["eos"]:   # the EOS is listed and counted, but adds no text
            assert lp["tokens"][-1] == tokenizer.eos_token and choice["finish_reason"] == "stop"
            assert choice["text"] == decoded
        else:
            assert choice["text"] == decoded + tokenizer.decode([greedy], clean_up_tokenization_spaces=False)


def test_chat_logprobs_list_the_final_eos(client, tokenizer):
    out = client.chat.completions.create(model="tiny", messages=STOPS_ON_EOS, max_tokens=40, temperature=0,
                                         logprobs=True, top_logprobs=1)
    content = out.choices[0].logprobs.content
    assert out.choices[0].finish_reason == "stop" and len(content) == out.usage.completion_tokens < 40
    assert content[-1].token == tokenizer.eos_token and tokenizer.eos_token not in out.choices[0].message.content


@pytest.mark.parametrize("prompt", [[-1, 5], [5, 400], [], [[]], [[4, 5], []], [[4], [400]]])
def test_bad_token_prompts_are_400_naming_prompt(server, prompt):
    response = httpx.post(f"{server.base_url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text


def test_a_refused_prompt_refuses_the_request(server):
    body = {"model": "tiny", "prompt": ["the keeper", "the keeper " * 300], "max_tokens": 4}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.post(f"{server.base_url}/v1/completions", json={**body, "prompt": ["a", 1]}).status_code == 422
    assert texts(complete(server, prompt=TEXTS, max_tokens=2)) != []   # nothing left admitted


def test_each_choice_of_an_experiment_request_is_logged(server):
    """(Without keys, creating an experiment works only because the config says allow_no_auth: true.)"""
    made = httpx.post(f"{server.base_url}/v1/experiments", json={"id": "multi", "arms": [{"name": "a", "model": "tiny"}]})
    assert made.status_code == 201, made.text
    out = complete(server, prompt=TEXTS, n=2, max_tokens=3, temperature=0, experiment="multi", user="u1")
    assert httpx.get(f"{server.base_url}/v1/experiments/multi").json()["requests"] == {"a": len(out["choices"])}
