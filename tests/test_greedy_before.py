"""The one engine's greedy outputs equal what rolemrc generated before it existed: tests/data/greedy_before.json was
written at commit d4523c0 by eval's HF `generate` path (batches of 8, left-padded), eval with a restraint per row,
and serve's earlier transformers engine, on the fixture models (rebuilt here by conftest exactly as then) and on
SmolLM2-135M-Instruct. Its `meta.how` says how each path was driven."""

import json
from pathlib import Path

import pytest
from fixtures import test_records as fixture_records

from rolemrc.core.chat import render_chat
from rolemrc.core.modeling import load_model
from rolemrc.core.records import normalize_record
from rolemrc.eval.generate import GenerateConfig, generate_rows
from rolemrc.generate.engine import eos_ids
from rolemrc.generate.offline import generate
from rolemrc.generate.params import SamplingParams
from rolemrc.intervene.spec import Restraint

RECORDED = json.loads((Path(__file__).parent / "data" / "greedy_before.json").read_text())["models"]
# SmolLM2 (135M parameters on the CPU, each decode step reads all its weights) is checked on the first 4 of its 8
# recorded records: still one batch of left-padded prompts of unequal length in which t1 ends early at EOS, and with
# restraints the rows' four restraints (none, r1, r2, r3) side by side, two of which change the reply (t2's then ends
# early too). The pad-token cases are the fixture models' (qwen2's t1, restrained peaked's t9), checked on all 12.
CHECKED = {"smollm2": 4}


def recorded_records(name):
    """The normalized fixture records a model's check runs on: the first of those recorded (CHECKED, else all)."""
    before = RECORDED[name]
    n = CHECKED.get(name, len(before["records"]))
    records = [normalize_record(r, k + 1, "test")[0] for k, r in enumerate(fixture_records()[:n])]
    assert [r["id"] for r in records] == before["records"][:n]
    return records


def model_dir(name, request):
    if name == "peaked":
        return request.getfixturevalue("peaked_model")
    if name == "smollm2":
        return request.getfixturevalue("smollm2_dir")
    return request.getfixturevalue("model_dirs")[name]


def check_path(model, tok, records, rows, config, before_rows):
    """Each response and token count equals the recorded one, except where eval cut a reply at a generated padding
    token (it read any pad id as HF `generate`'s fill after EOS: one qwen2 reply, one restrained peaked one): there
    the engine's ids must equal the recorded ones up to and including that token, and it goes on, as serve did."""
    now = {r["id"]: (r["response"], r["tokens"]) for r in generate_rows(model, tok, records, rows, config)}
    for record, restraint in zip(records, rows):
        before = before_rows[record["id"]]
        if before["ids"][-1] == tok.pad_token_id and tok.pad_token_id not in eos_ids(model, tok):
            prompt = tok(render_chat(tok, record["question"]), add_special_tokens=False)["input_ids"]
            params = SamplingParams(max_tokens=config.max_new_tokens, temperature=0)
            ids = generate(model, tok, [prompt], params, [restraint], progress=False)[0].token_ids
            assert ids[:len(before["ids"])] == before["ids"] and now[record["id"]][1] > before["tokens"]
        else:
            assert now[record["id"]] == (before["response"], before["tokens"]), record["id"]


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2", "peaked", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_eval_and_per_row_restraints_generate_what_they_did_before(name, request):
    before = RECORDED[name]
    model, tok = load_model(model_dir(name, request), device="cpu", dtype=before["dtype"])
    records = recorded_records(name)
    config = GenerateConfig(model=str(model_dir(name, request)), max_new_tokens=before["max_new_tokens"], batch_size=8,
                            progress=False)
    check_path(model, tok, records, [None] * len(records), config, before["eval"])
    restraints = [Restraint.from_dict(d) if d else None for d in before["restraints"]]
    check_path(model, tok, records, [restraints[i % len(restraints)] for i in range(len(records))], config,
               before["eval_restrained"])


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2", "peaked", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_serve_generates_what_it_did_before(name, request):
    """All records submitted at once to serve's transformers engine (max_batch 8, as recorded; SmolLM2: CHECKED)."""
    import asyncio

    from rolemrc.serve.engines.base import Prompt, Resolved
    from rolemrc.serve.engines.transformers import TransformersEngine, TransformersOptions

    before = RECORDED[name]
    records = recorded_records(name)

    async def run() -> dict:
        engine = TransformersEngine("greedy", TransformersOptions(path=str(model_dir(name, request)), device="cpu"),
                                    max_batch=8, max_queue=64)
        await engine.start()
        try:
            params = SamplingParams(max_tokens=before["max_new_tokens"], temperature=0)
            gens = [await engine.submit(Prompt(messages=r["question"]), params, Resolved()) for r in records]
            texts = [await g.text() for g in gens]
            return {r["id"]: (t, g.final.completion_tokens) for r, t, g in zip(records, texts, gens)}
        finally:
            await engine.stop()

    assert asyncio.run(run()) == {r["id"]: (before["serve"][r["id"]]["text"], before["serve"][r["id"]]["completion_tokens"])
                                  for r in records}
