"""Mixed restraints in one batch on the transformers engine: rows under different restraints (and none) share every
forward, rows join a running batch whatever its restraints, and each row's tokens and log-probabilities are those of
its restraint alone (engine level and over real HTTP)."""

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from fixtures import corpus, save_peaked_llama

from rolemrc.generate.params import SamplingParams
from rolemrc.intervene import Restraint
from rolemrc.serve.engines.base import Generation, Prompt, Resolved
from rolemrc.serve.engines.transformers import TransformersEngine, TransformersOptions
from rolemrc.serve.launch import running_server

CHAT = [{"role": "user", "content": "the keeper of the lighthouse watched storms"}]
NAMES = ["r0", "r1", "r2", "r3"]


def restraints() -> list[Restraint]:
    """Four different restraints on the 2 x 96 mlp.act units of the peaked Llama."""
    rng = random.Random(0)
    return [Restraint(name=n, hook="mlp.act", factor=f, units={0: sorted(rng.sample(range(96), 48)),
                                                               1: sorted(rng.sample(range(96), 48))})
            for n, f in zip(NAMES, (0.0, 0.0, 0.5, 2.0))]


@pytest.fixture(scope="module")
def peaked(tmp_path_factory, tokenizer):
    return save_peaked_llama(tmp_path_factory.mktemp("peaked-mixed"), tokenizer)


def test_rows_under_different_restraints_share_forwards_and_join_running_batches(peaked):
    """Five requests (4 restraints and none) admitted together run as one batch (every forward has 5 rows); a
    request with another restraint arriving mid-generation joins the running batch; each equals its run alone."""
    rs = restraints()
    variants = [None, *rs]

    async def go() -> tuple[list[int], list, list, list, list[int]]:
        engine = TransformersEngine("t", TransformersOptions(path=str(peaked)), max_batch=8, max_queue=16)
        rows: list[int] = []
        engine.model.register_forward_pre_hook(lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)

        async def submit(r: Restraint | None, tokens: int) -> Generation:
            return await engine.submit(Prompt(messages=CHAT), SamplingParams(max_tokens=tokens, temperature=0,
                                                                             ignore_eos=True, logprobs=1),
                                       Resolved(r, r.name if r else "none", f"name:{r.name}" if r else ""))

        async def tokens(gen: Generation) -> tuple[list[str], list[float]]:
            async with gen:
                out = await gen.collect()
            return [lp.token for lp in out.logprobs], [lp.logprob for lp in out.logprobs]

        async def run(r: Restraint | None, n: int) -> tuple[list[str], list[float]]:
            return await tokens(await submit(r, n))

        admitted = [await submit(r, 8) for r in variants]   # all waiting before the scheduler starts
        await engine.start()
        try:
            together = await asyncio.gather(*map(tokens, admitted))
            shared = list(rows)
            rows.clear()
            long = asyncio.ensure_future(run(rs[0], 200))
            while not rows:
                await asyncio.sleep(0.01)
            late = await run(rs[1], 8)
            await long
            joined = list(rows)
            alone = [await run(r, 8) for r in variants]
        finally:
            await engine.stop()
        return shared, together, alone, late, joined

    shared, together, alone, late, joined = asyncio.run(go())
    assert shared == [5] * 8                     # one prefill and 7 steps, all 5 rows in each
    assert len({tuple(tokens) for tokens, _ in alone}) >= 3   # the restraints change the output: a mix-up would show
    assert 2 in joined                           # r1 joined r0's running batch
    for (tokens, logprobs), (want, want_logprobs) in zip([*together, late], [*alone, alone[2]]):
        assert tokens == want
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), rtol=0, atol=1e-4)


def test_slot_scales_restrain_each_row_alone_and_release_slots(model_dirs):
    """Rows under different restraints (and none) in one forward equal separate runs under `applied`; a released
    slot goes back to ones, and a site's hook is removed once no slot restrains it."""
    from rolemrc.core.hooks import site
    from rolemrc.core.modeling import load_model
    from rolemrc.generate.scales import SlotScales
    from rolemrc.intervene.runtime import applied

    model, tok = load_model(model_dirs["llama"], device="cpu")
    a, b = Restraint(name="a", hook="mlp.act", factor=0.0, units={0: [1, 5]}), restraints()[2]   # b: layers 0 and 1
    ids = torch.tensor([tok(CHAT[0]["content"])["input_ids"]])
    with torch.inference_mode():
        with applied(model, a):
            alone_a = model(input_ids=ids).logits[0]
        with applied(model, b):
            alone_b = model(input_ids=ids).logits[0]
        plain = model(input_ids=ids).logits[0]
    scales = SlotScales(model, 4)
    scales.assign(0, a)
    scales.assign(2, b)
    scales.assign(3, None)

    def run(rows: list[int]) -> torch.Tensor:
        scales.rows = torch.tensor(rows)
        return model(input_ids=ids.expand(len(rows), -1)).logits

    with torch.inference_mode():
        mixed = run([2, 1, 0, 3])
        assert not torch.allclose(alone_a, plain) and not torch.allclose(alone_b, plain)
        for row, want in zip(mixed, [alone_b, plain, alone_a, plain]):
            torch.testing.assert_close(row, want, rtol=0, atol=1e-5)
        assert scales.sites == (("mlp.act", 0, ("scale",)), ("mlp.act", 1, ("scale",)))
        scales.release(2)
        assert scales.sites == (("mlp.act", 0, ("scale",)),)   # only b restrained layer 1
        assert bool((scales.tables[("mlp.act", 0)]["scale"][2] == 1).all())
        torch.testing.assert_close(run([2, 0])[0], plain, rtol=0, atol=1e-5)
        scales.release(0)
        assert scales.sites == ()
        assert not site(model, "mlp.act", 0).module._forward_hooks and not site(model, "mlp.act", 1).module._forward_hooks
        torch.testing.assert_close(run([0])[0], plain, rtol=0, atol=0)


def test_concurrent_requests_equal_the_offline_api(peaked, tokenizer):
    """Twelve fixture prompts submitted at once to an engine of 4 slots (so requests wait, join and leave) get the
    offline API's greedy texts."""
    from rolemrc.core.modeling import load_model
    from rolemrc.generate.offline import generate

    prompts = corpus(12, seed=4)
    params = SamplingParams(max_tokens=12, temperature=0)

    async def served() -> tuple[list[str], list[list[int]]]:
        engine = TransformersEngine("t", TransformersOptions(path=str(peaked)), max_batch=4, max_queue=16)
        await engine.start()
        try:
            gens = [await engine.submit(Prompt(text=p), params, Resolved()) for p in prompts]

            async def text(gen: Generation) -> str:
                async with gen:
                    return await gen.text()

            return await asyncio.gather(*map(text, gens)), [engine.encode(Prompt(text=p)) for p in prompts]
        finally:
            await engine.stop()

    texts, ids = asyncio.run(served())
    model, tok = load_model(peaked, device="cpu")
    offline = generate(model, tok, ids, params, progress=False)
    assert [c.text for c in offline] == texts
    assert len(set(texts)) > 6


def test_a_failed_forward_ends_its_requests_with_500_and_the_engine_serves_on(peaked, tokenizer):
    """A forward that raises (here on a poisoned prompt) ends the requests it ran with a 500; the request waiting
    behind them then runs as if nothing happened, and the engine stays healthy."""
    from rolemrc.serve.errors import ApiError

    poison = tokenizer("storms storms storms")["input_ids"]
    params = SamplingParams(max_tokens=6, temperature=0)

    def refuse(_module, _args, kwargs):
        if kwargs["input_ids"].shape[1] == len(poison) and kwargs["input_ids"][0].tolist() == poison:
            raise RuntimeError("poisoned forward")

    async def go() -> tuple[list[str], str, str, tuple]:
        engine = TransformersEngine("t", TransformersOptions(path=str(peaked)), max_batch=1, max_queue=16)
        await engine.start()
        try:
            alone = await (await engine.submit(Prompt(text="a baker in the old"), params, Resolved())).text()
            engine.model.register_forward_pre_hook(refuse, with_kwargs=True)
            bad = await engine.submit(Prompt(token_ids=poison), params, Resolved())
            good = await engine.submit(Prompt(text="a baker in the old"), params, Resolved())
            errors = []
            try:
                await bad.text()
            except ApiError as exc:
                errors.append(f"{exc.status} {exc}")
            after = await asyncio.wait_for(good.text(), 60)   # a dead scheduler thread would never answer
            health = engine.health()
        finally:
            await engine.stop()   # joins the scheduler thread: its last counts are in
        return errors, alone, after, (health, dict(engine.running), dict(engine.queue_depth()))

    errors, alone, after, (health, running, waiting) = asyncio.run(go())
    assert errors == ["500 generation failed: RuntimeError"]   # what it said stays in the server log
    assert after == alone and alone
    assert health == ("ok", None) and running == {"none": 0} and waiting == {}


@pytest.fixture(scope="module")
def server(peaked, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-mixed")
    for r in restraints():
        r.save(root / f"{r.name}.yaml")
    config = {"models": {"peaked": {"path": str(peaked)}}, "restraints": {n: f"{n}.yaml" for n in NAMES},
              "max_batch": 16, "db": None}
    with running_server(config, workdir=root) as srv:
        yield srv


def test_mixed_restraints_sent_concurrently_match_sequential_runs_over_http(server):
    """Greedy requests under 4 restraints and none, sent concurrently, get the tokens of sequential runs of each
    variant alone and its log-probabilities within float tolerance."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)

    def ask(model: str) -> tuple[list[str], list[float]]:
        out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0, logprobs=True,
                                             extra_body={"ignore_eos": True})
        content = out.choices[0].logprobs.content
        return [t.token for t in content], [t.logprob for t in content]

    models = ["peaked", *(f"peaked+{n}" for n in NAMES)]
    alone = {m: ask(m) for m in models}
    assert len({tuple(tokens) for tokens, _ in alone.values()}) >= 3
    jobs = models * 4
    random.Random(1).shuffle(jobs)
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(ask, jobs))
    for model, (tokens, logprobs) in zip(jobs, got):
        assert tokens == alone[model][0], model
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(alone[model][1]), rtol=0, atol=1e-4)
