"""The generation engine against transformers itself: greedy tokens, chunked prefill, slots reused and grown,
log-probabilities, stop strings and cancellation."""

import copy

import pytest
import torch

from rolemrc.core.chat import render_chat
from rolemrc.core.modeling import load_model
from rolemrc.generate.engine import Engine, Request
from rolemrc.generate.offline import generate
from rolemrc.generate.params import SamplingParams
from rolemrc.intervene import Restraint, applied

QUESTIONS = ["who keeps the lighthouse", "the baker sings at dawn to the ovens and the bread",
             "tell me about the river that floods every spring and the town beside it, and the keeper", "storms",
             "a keeper", "what does the baker knead before the sun is up over the rocks", "the sea", "dawn"]


def prompts_of(tok, n=len(QUESTIONS)):
    return [tok(render_chat(tok, [{"role": "user", "content": q}]), add_special_tokens=False)["input_ids"]
            for q in QUESTIONS[:n]]


def hf_greedy(model, tok, prompt, tokens):
    """One request alone through `model.generate`: the reference every batching must reproduce."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    return out[0, len(prompt):].tolist()


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_greedy_tokens_equal_transformers_one_request_at_a_time(model_dirs, arch):
    """Eight prompts of different lengths through three slots: rows join and leave by slot mid-generation."""
    model, tok = load_model(model_dirs[arch], device="cpu")
    prompts = prompts_of(tok)
    done = generate(model, tok, prompts, GREEDY, max_batch=3, progress=False)
    assert [c.token_ids for c in done] == [hf_greedy(model, tok, p, 12) for p in prompts]
    assert all(c.finish_reason == "length" and c.prompt_tokens == len(p) for c, p in zip(done, prompts))


def drive(engine, requests, after=None):
    """Add `requests`, step until done; `after` = (steps, late requests) added after that many steps."""
    with torch.inference_mode():
        for r in requests:
            engine.add(r)
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
            if after and steps == after[0]:
                for r in after[1]:
                    engine.add(r)
    return requests + (after[1] if after else [])


def test_chunked_prefill_and_a_growing_cache_change_nothing(model_dirs):
    """A prefill of 5 tokens per forward (each prompt in many chunks, decode steps in between) and a late
    request that outgrows the cache while others decode give the same tokens as one pass."""
    model, tok = load_model(model_dirs["llama"], device="cpu")
    prompts = prompts_of(tok)
    whole = [c.token_ids for c in generate(model, tok, prompts, GREEDY, max_batch=8, progress=False)]
    engine = Engine(model, tok, max_batch=3, prefill_tokens=5)
    long = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
    late = Request(prompts[4], long, 150, lambda o: None, text=False)
    requests = drive(engine, [Request(p, GREEDY, 12, lambda o: None, text=False) for p in prompts[:4]], (3, [late]))
    assert engine.cache.parking >= len(prompts[4]) + 150 > 128   # the page table grew while others decoded
    assert [r.out for r in requests[:4]] == whole[:4]
    assert late.out == hf_greedy(model, tok, prompts[4], 150)
    chunked = drive(Engine(model, tok, max_batch=2, prefill_tokens=5),
                    [Request(p, GREEDY, 12, lambda o: None, text=False) for p in prompts])
    assert [r.out for r in chunked] == whole
    assert sorted(engine.free) == [0, 1, 2] and not engine.scales.held


def test_shared_prefixes_are_copied_not_computed_and_change_nothing(model_dirs):
    """Prompts that share a long system prompt: after the first group, the others copy its positions (also from a
    freed slot), and every token equals one request alone through transformers; a restraint keeps its own copy."""
    model, tok = load_model(model_dirs["llama"], device="cpu")
    system = "you are the keeper of the lighthouse on the rocks and you watch the storm " * 4
    prompts = [tok(render_chat(tok, [{"role": "system", "content": system}, {"role": "user", "content": q}]),
                   add_special_tokens=False)["input_ids"] for q in QUESTIONS]
    engine = Engine(model, tok, max_batch=3)
    requests = drive(engine, [Request(p, GREEDY, 12, lambda o: None, text=False) for p in prompts])
    assert [r.out for r in requests] == [hf_greedy(model, tok, p, 12) for p in prompts]
    shared = min(len(p) for p in prompts) // 2
    assert engine.stats["prompt_tokens_reused"] >= (len(prompts) - 1) * shared
    restraint = Restraint(name="r", hook="mlp.act", factor=0.0, units={0: list(range(0, 96, 3))})
    engine.stats.clear()
    restrained = drive(engine, [Request(p, GREEDY, 12, lambda o: None, restraint, text=False) for p in prompts[:2]])
    assert [r.out for r in restrained] != [r.out for r in requests[:2]]   # so reusing unrestrained keys would show
    with applied(model, restraint):
        assert [r.out for r in restrained] == [hf_greedy(model, tok, p, 12) for p in prompts[:2]]


def test_logprobs_of_steps_and_prompts_equal_a_plain_forward(model_dirs):
    """Each chosen token's log-probability and the prompt's (scored over several prefill chunks) equal the
    log-softmax of one forward over the whole text."""
    model, tok = load_model(model_dirs["qwen2"], device="cpu")
    prompts = prompts_of(tok, 3)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=True)
    outputs: dict[int, list] = {i: [] for i in range(3)}
    requests = drive(Engine(model, tok, max_batch=3, prefill_tokens=7),
                     [Request(p, params, 6, outputs[i].append) for i, p in enumerate(prompts)])
    with torch.inference_mode():
        for i, (p, r) in enumerate(zip(prompts, requests)):
            entries = [e for o in outputs[i] for e in o.logprobs]
            assert len(entries) == len(p) + 6 and entries[0].logprob is None
            text = torch.tensor([p + r.out[:-1]])
            logp = model(text).logits[0].float().log_softmax(-1)
            expected = [*logp[torch.arange(text.shape[1] - 1), text[0, 1:]].tolist(), logp[-1, r.out[-1]].item()]
            assert [e.logprob for e in entries[1:]] == pytest.approx(expected, abs=1e-4)
            assert all(len(e.top) == 3 for e in entries[1:])


def test_stop_strings_and_cancellation_free_their_slots(peaked_model):
    model, tok = load_model(peaked_model, device="cpu")
    prompts = prompts_of(tok, 4)
    free_run = generate(model, tok, prompts[:1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                        progress=False)[0]
    stop = free_run.text[len(free_run.text) // 2:][:3]
    assert stop.strip()
    stopped = generate(model, tok, prompts[:1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                               stop=[stop]), progress=False)[0]
    assert stopped.finish_reason == "stop" and stopped.text == free_run.text[:free_run.text.index(stop)]
    engine = Engine(model, tok, max_batch=2)
    cancel = {"now": False}
    outs: list = []
    with torch.inference_mode():
        engine.add(Request(prompts[0], GREEDY, 12, outs.append, cancelled=lambda: cancel["now"]))
        engine.step()
        cancel["now"] = True
        engine.step()
        assert outs[-1].finish_reason == "cancelled" and not engine.has_work()
        assert sorted(engine.free) == [0, 1]


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_sliding_window_layers_see_only_their_window(tokenizer, arch):
    """A Mistral whose every layer slides over 8 positions, and a Qwen2 with one full and one sliding layer: the
    engine's masks (one windowed mask; a mask per layer type) give transformers' own tokens on prompts longer
    than the window, and those differ from what full attention gives."""
    from transformers import AutoModelForCausalLM

    from rolemrc.core.tiny import tiny_config

    config = tiny_config(arch, len(tokenizer), hidden=64, layers=2, intermediate=96)
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    torch.manual_seed(5)
    full = AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
    config.sliding_window = 8
    if arch == "qwen2":
        config.use_sliding_window, config.layer_types = True, ["full_attention", "sliding_attention"]
    model = AutoModelForCausalLM.from_config(config).eval()
    model.load_state_dict(full.state_dict())
    prompts = prompts_of(tokenizer, 4)
    assert min(len(p) for p in prompts) > 8
    done = generate(model, tokenizer, prompts, GREEDY, max_batch=2, progress=False)
    expected = [hf_greedy(model, tokenizer, p, 12) for p in prompts]
    assert [c.token_ids for c in done] == expected
    assert expected != [hf_greedy(full, tokenizer, p, 12) for p in prompts]


def test_an_oom_growing_the_cache_ends_only_the_requests_being_admitted(model_dirs, monkeypatch):
    """The cache runs out of memory while growing for a late long request (injected: the third buffer it makes
    fails): that request ends `out_of_memory`, the cache is exactly as it was (no layer half grown), the requests
    already decoding finish with their own tokens, and the next request is served in full."""
    import rolemrc.generate.cache as cache_module

    model, tok = load_model(model_dirs["llama"], device="cpu")
    prompts = prompts_of(tok)
    whole = [c.token_ids for c in generate(model, tok, prompts[:4], GREEDY, max_batch=8, progress=False)]
    engine = Engine(model, tok, max_batch=4)

    class FailingTorch:
        """torch, but its third `zeros` runs out of memory."""

        calls = 0

        def __getattr__(self, name):
            return getattr(torch, name)

        def zeros(self, *args, **kwargs):
            FailingTorch.calls += 1
            if FailingTorch.calls == 3:
                raise torch.OutOfMemoryError("injected")
            return torch.zeros(*args, **kwargs)

    outputs = []
    early = [Request(p, GREEDY, 12, lambda o: None, text=False) for p in prompts[:3]]
    late = Request(prompts[4], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True), 400, outputs.append,
                   text=False)
    with torch.inference_mode():
        for r in early:
            engine.add(r)
        engine.step()   # the early ones are decoding: the cache holds what they need
        before = {layer: (k.shape, k.data_ptr()) for layer, k in engine.cache.keys.items()}
        monkeypatch.setattr(cache_module, "torch", FailingTorch())
        engine.add(late)
        engine.step()
        monkeypatch.setattr(cache_module, "torch", torch)
        assert {layer: (k.shape, k.data_ptr()) for layer, k in engine.cache.keys.items()} == before
        assert outputs[-1].finish_reason == "out_of_memory" and late.slot == -1
        check_pages(engine.cache)
    drive(engine, [])
    assert [r.out for r in early] == whole[:3]
    again = drive(engine, [Request(prompts[3], GREEDY, 12, lambda o: None, text=False)])
    assert again[0].out == whole[3] and sorted(engine.free) == [0, 1, 2, 3]


def check_pages(cache):
    """The page bookkeeping is whole: every page but NULL is spare or held, held as often as slots list it, and
    each slot's table row lists its pages then NULL."""
    from collections import Counter

    from rolemrc.generate.cache import NULL

    held = Counter(p for pages in cache.owned for p in pages)
    assert sorted([*cache.spare, *held]) == list(range(1, cache.pages)) and NULL not in held
    assert all(cache.refs[p] == n for p, n in held.items())
    for slot, pages in enumerate(cache.owned):
        row = cache.table[slot].tolist()
        assert row[:len(pages)] == pages and set(row[len(pages):]) <= {NULL}


def test_each_request_holds_its_own_pages_and_waits_for_pages_to_come_free(model_dirs):
    """One long request among short ones: the cache holds what they need, not max_batch x the longest, and the
    long one gets the tokens it gets alone. Under a
    budget of two requests' pages, four requests run two at a time, each with the tokens it gets alone; a request
    that can never fit is refused when added."""
    from rolemrc.generate.cache import PAGE, pages_for

    model, tok = load_model(model_dirs["llama"], device="cpu")
    prompts = prompts_of(tok)
    engine = Engine(model, tok, max_batch=8)
    long = Request(prompts[2], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True), 400, lambda o: None,
                   text=False)
    short = [Request(p, GREEDY, 12, lambda o: None, text=False) for p in prompts[3:8]]
    with torch.inference_mode():
        for r in [long, *short]:
            engine.add(r)
        engine.step()
        need = sum(pages_for(len(r.prompt) + r.max_tokens) for r in [long, *short])
        assert sum(map(len, engine.cache.owned)) == need
        assert engine.cache.pages <= 2 * need + 2 < 8 * pages_for(len(prompts[2]) + 400)
        check_pages(engine.cache)
    drive(engine, [])
    alone = drive(Engine(model, tok, max_batch=1), [Request(prompts[2], long.params, 400, lambda o: None,
                                                            text=False)])[0]
    assert long.out == alone.out   # (transformers' own generate parts from both at token 68: float noise)

    needs = sorted(pages_for(len(p) + 12) for p in prompts[:4])
    budget = (needs[-1] + needs[-2]) * PAGE
    tight = Engine(model, tok, max_batch=8, kv_positions=budget)
    requests = [Request(p, GREEDY, 12, lambda o: None, text=False) for p in prompts[:4]]
    running = []
    with torch.inference_mode():
        for r in requests:
            tight.add(r)
        while tight.has_work():
            tight.step()
            running.append(len(tight.running))
            assert sum(map(len, tight.cache.owned)) <= tight.cache.max_pages - 1
            check_pages(tight.cache)
    assert max(running) == 2 and [r.out for r in requests] == [hf_greedy(model, tok, p, 12) for p in prompts[:4]]
    with pytest.raises(ValueError, match="can never fit"):
        tight.add(Request(prompts[0], SamplingParams(max_tokens=budget), budget, lambda o: None, text=False))

