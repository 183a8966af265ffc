"""The field's own clients drive `rolemrc serve` unchanged, on both engines: lm-evaluation-harness scores a
multiple-choice task through `local-completions` in its default (tokenized, batched) mode and must get every
choice's log-likelihood and the accuracy of its own in-process `hf` backend on the same weights; a
`generate_until` task through `local-chat-completions` must equal the `hf` backend's greedy generations; guidellm
runs a short concurrency profile with no failed request.

Each client runs once for the module and the tests assert on its results: one lm-eval process (its Python entry
point, `simple_evaluate`, as `rolemrc bench clients` runs it) holds every evaluation the tests compare, the `hf`
backend's reference, then per engine its choices and its chat prompts; one guidellm process runs its CLI's profile
against each engine in turn.

The model ends sequences often (its greedy next token is EOS at about a quarter of positions), so choices whose
greedy continuation is EOS occur: lm-eval sums `token_logprobs[ctxlen:-1]`, so the generated token's entry must be
there even when it is EOS.

Each client lives in its own environment (`make test` builds `.venv-lmeval` and `.venv-guidellm` and sets
ROLEMRC_LMEVAL_PYTHON / ROLEMRC_GUIDELLM_PYTHON; with ROLEMRC_REQUIRE_CLIENTS=1, as there, a missing client fails
instead of skipping). vLLM as in test_serve_vllm.py."""

import json
import os
import random
import time
from collections import Counter

import httpx
import pytest
import torch
from fixtures import EAGER, WORDS, corpus, save_eos_llama

from rolemrc.bench.clients import (
    CLIENTS,
    choice_lls,
    client_python,
    generations,
    guidellm_runs,
    lm_eval_runs,
    served_args,
    write_tasks,
)
from rolemrc.core.errors import InputError
from rolemrc.serve.engines.vllm import vllm_python
from rolemrc.serve.errors import ServeConfigError
from rolemrc.serve.launch import start_server, stop_server

for name in CLIENTS:
    try:
        client_python(name)
    except InputError as exc:
        if os.environ.get("ROLEMRC_REQUIRE_CLIENTS") == "1":
            raise
        pytest.skip(str(exc), allow_module_level=True)
try:
    VLLM = vllm_python("test")
except ServeConfigError:
    if os.environ.get("ROLEMRC_REQUIRE_VLLM") == "1":
        raise
    VLLM = None
ENGINES = ["t", "v"] if VLLM else ["t"]   # served model names: the transformers engine, vLLM
ATOL = 1e-4          # per choice log-likelihood, float32


def words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    return save_eos_llama(tmp_path_factory.mktemp("eos-llama"), tokenizer, corpus(60, seed=1))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """`rolemrc_mc` (12 questions x 4 choices of 1-3 words) and `rolemrc_gen` (6 prompts, up to 16 tokens)."""
    rng = random.Random(0)
    mc = [{"question": f"question: {words(rng, 3, 12)}\nanswer:", "choices": [words(rng, 1, 3) for _ in range(4)],
           "answer": rng.randrange(4)} for _ in range(12)]
    gen = [{"prompt": words(rng, 4, 14), "reference": words(rng, 2, 5)} for _ in range(6)]
    return write_tasks(tmp_path_factory.mktemp("tasks"), mc, gen)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    models = {"t": {"path": str(model_dir)}}
    if VLLM:
        models["v"] = {"engine": "vllm", "path": str(model_dir), "max_model_len": 512, "vllm_args": EAGER}
    srv = start_server({"models": models, "max_new_tokens": 64, "db": None},
                       workdir=tmp_path_factory.mktemp("serve-clients"), env={"ROLEMRC_VLLM_PYTHON": VLLM or ""},
                       timeout=600)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def evaluations(server, model_dir, tasks, tmp_path_factory) -> dict[tuple[str, str], tuple[dict, dict] | RuntimeError]:
    """(who, task) -> lm-eval's (metrics, doc_id -> responses): "hf" (its in-process backend on the same weights,
    the reference) and each served engine, "rolemrc_mc" through `local-completions` in its default mode and
    "rolemrc_gen" through `local-chat-completions` with the chat template; all from one lm-eval process."""
    reference = f"pretrained={model_dir},dtype=float32"
    runs = {("hf", "rolemrc_mc"): ("rolemrc_mc", "hf", reference), ("hf", "rolemrc_gen"): ("rolemrc_gen", "hf", reference)}
    for engine in ENGINES:
        runs[engine, "rolemrc_mc"] = ("rolemrc_mc", "local-completions",
                                      served_args(server.base_url, engine, "completions", model_dir))
        runs[engine, "rolemrc_gen"] = ("rolemrc_gen", "local-chat-completions",
                                       served_args(server.base_url, engine, "chat/completions", model_dir))
    return dict(zip(runs, lm_eval_runs(tmp_path_factory.mktemp("lm-eval"), tasks, list(runs.values())), strict=True))


def evaluation(evaluations, who: str, task: str) -> tuple[dict, dict]:
    result = evaluations[who, task]
    if isinstance(result, RuntimeError):
        raise result
    return result


def test_some_choices_continue_greedily_with_eos(model_dir, tasks, tokenizer):
    """The task meets the case a server gets wrong by dropping the generated EOS token's entry."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    docs = [json.loads(line) for line in (tasks / "rolemrc_mc.jsonl").read_text().splitlines()]
    texts = [d["question"] + " " + c for d in docs for c in d["choices"]]
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        greedy = model(**batch).logits[:, -1].argmax(-1)
    assert 4 <= (greedy == tokenizer.eos_token_id).sum() < len(texts) // 2


@pytest.mark.parametrize("engine", ENGINES)
def test_lm_eval_loglikelihoods_equal_its_hf_backend(evaluations, engine):
    hf_metrics, hf_docs = evaluation(evaluations, "hf", "rolemrc_mc")
    metrics, docs = evaluation(evaluations, engine, "rolemrc_mc")
    assert docs.keys() == hf_docs.keys() == set(range(12))
    ours, reference = torch.tensor(choice_lls(docs), dtype=torch.float64), torch.tensor(choice_lls(hf_docs), dtype=torch.float64)
    assert len(ours) == len(reference) == 48
    assert (ours - reference).abs().max() <= ATOL, f"max |difference| {(ours - reference).abs().max():.3g}"
    assert [g for i in sorted(docs) for _, g in docs[i]] == [g for i in sorted(hf_docs) for _, g in hf_docs[i]]
    assert metrics["acc,none"] == hf_metrics["acc,none"]


@pytest.mark.parametrize("engine", ENGINES)
def test_lm_eval_chat_generations_equal_greedy(evaluations, engine):
    _, docs = evaluation(evaluations, engine, "rolemrc_gen")
    assert generations(docs) == generations(evaluation(evaluations, "hf", "rolemrc_gen")[1])
    assert sum(len(r[0]) > 0 for r in docs.values()) >= 3   # not all empty: greedy text to compare


def answered(server, model: str) -> Counter:
    """Requests the server has answered for `model`, by HTTP status (its Prometheus counter)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = Counter()
    for family in text_string_to_metric_families(httpx.get(f"{server.base_url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "rolemrc_requests_total" and sample.labels["model"] == model:
                counts[sample.labels["status"]] += int(sample.value)
    return counts


@pytest.fixture(scope="module")
def profiles(server, model_dir, tmp_path_factory) -> tuple[dict[str, Counter], dict[str, dict | RuntimeError]]:
    """(the requests the server had answered per engine before, guidellm's benchmark per engine): 4 streams x 16
    requests each, every engine from one guidellm process (one worker process holding the 4 streams)."""
    before = {engine: answered(server, engine) for engine in ENGINES}
    return before, guidellm_runs(tmp_path_factory.mktemp("guidellm"), server.base_url, ENGINES, model_dir, streams=4,
                                 requests=16, processes=1)


@pytest.mark.parametrize("engine", ENGINES)
def test_guidellm_concurrency_profile_has_no_failures(server, profiles, engine):
    before, benchmarks = profiles
    if isinstance(benchmarks[engine], RuntimeError):
        raise benchmarks[engine]
    metrics = benchmarks[engine]["metrics"]
    deadline = time.monotonic() + 30   # the last answers may still be on their way when guidellm exits
    while (delta := answered(server, engine) - before[engine]).total() < 16 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert delta == Counter({"200": 16})   # all sent, all answered
    # guidellm 0.8.1 may close its report before the last few answers arrive (a race of its own): it counts fewer
    totals = metrics["request_totals"]
    assert totals["errored"] == totals["incomplete"] == 0 and 4 <= totals["successful"] == totals["total"] <= 16
    assert metrics["output_token_count"]["successful"]["total_sum"] == 32 * totals["successful"]   # each its 32 tokens
    assert metrics["request_concurrency"]["successful"]["max"] == 4   # its 4 streams at once, from one worker process
