"""The field's own clients drive `rolemrc serve` unchanged, on both engines: lm-evaluation-harness scores a
multiple-choice task through `local-completions` in its default (tokenized, batched) mode and must get every
choice's log-likelihood and the accuracy of its own in-process `hf` backend on the same weights; a
`generate_until` task through `local-chat-completions` must equal the `hf` backend's greedy generations; guidellm
runs a short concurrency profile with no failed request.

The model ends sequences often (its greedy next token is EOS at about a quarter of positions), so choices whose
greedy continuation is EOS occur: lm-eval sums `token_logprobs[ctxlen:-1]`, so the generated token's entry must be
there even when it is EOS.

Each client lives in its own environment (`make test` builds `.venv-lmeval` and `.venv-guidellm` and sets
ROLEMRC_LMEVAL_PYTHON / ROLEMRC_GUIDELLM_PYTHON; with ROLEMRC_REQUIRE_CLIENTS=1, as there, a missing client fails
instead of skipping). vLLM as in test_serve_vllm.py."""

import json
import os
import random
import shutil
import subprocess

import pytest
import torch
import yaml
from fixtures import WORDS, corpus, save_eos_llama

from rolemrc.serve.engines.vllm import vllm_python
from rolemrc.serve.errors import ConfigError
from rolemrc.serve.launch import start_server, stop_server


def client_python(env: str) -> str | None:
    """The interpreter named by $`env`; missing: skip, or fail under ROLEMRC_REQUIRE_CLIENTS=1."""
    python = os.environ.get(env)
    if python and shutil.which(python):
        return python
    if os.environ.get("ROLEMRC_REQUIRE_CLIENTS") == "1":
        raise RuntimeError(f"{env} must name the Python of that client's environment (`make clients` builds them)")
    pytest.skip(f"{env} is not set (`make clients`)", allow_module_level=True)


LMEVAL, GUIDELLM = client_python("ROLEMRC_LMEVAL_PYTHON"), client_python("ROLEMRC_GUIDELLM_PYTHON")
try:
    VLLM = vllm_python("test")
except ConfigError:
    if os.environ.get("ROLEMRC_REQUIRE_VLLM") == "1":
        raise
    VLLM = None
ENGINES = ["t", "v"] if VLLM else ["t"]   # served model names: the transformers engine, vLLM
ATOL = 1e-4          # per choice log-likelihood, float32
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    return save_eos_llama(tmp_path_factory.mktemp("eos-llama"), tokenizer, corpus(60, seed=1))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """A folder for `--include_path`: `rolemrc_mc` (12 questions x 4 choices of 1-3 words, JSON data) and
    `rolemrc_gen` (6 prompts, greedy up to 16 tokens)."""
    root = tmp_path_factory.mktemp("tasks")
    rng = random.Random(0)
    mc = [{"question": f"question: {words(rng, 3, 12)}\nanswer:", "choices": [words(rng, 1, 3) for _ in range(4)],
           "answer": rng.randrange(4)} for _ in range(12)]
    gen = [{"prompt": words(rng, 4, 14), "reference": words(rng, 2, 5)} for _ in range(6)]
    for name, docs, spec in [
        ("rolemrc_mc", mc, {"output_type": "multiple_choice", "doc_to_text": "{{question}}",
                            "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
                            "metric_list": [{"metric": "acc"}]}),
        ("rolemrc_gen", gen, {"output_type": "generate_until", "doc_to_text": "{{prompt}}",
                              "doc_to_target": "{{reference}}",
                              "generation_kwargs": {"until": ["\n\n"], "max_gen_toks": 16, "do_sample": False,
                                                    "temperature": 0},
                              "metric_list": [{"metric": "exact_match"}]})]:
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (root / f"{name}.yaml").write_text(yaml.safe_dump({
            "task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", **spec}))
    return root


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    models = {"t": {"path": str(model_dir)}}
    if VLLM:
        models["v"] = {"engine": "vllm", "path": str(model_dir), "max_model_len": 512}
    srv = start_server({"models": models, "max_new_tokens": 64, "db": None},
                       workdir=tmp_path_factory.mktemp("serve-clients"), env={"ROLEMRC_VLLM_PYTHON": VLLM or ""},
                       timeout=600)
    yield srv
    stop_server(srv)


def lm_eval(out, tasks, task: str, model: str, model_args: str, *extra: str) -> tuple[dict, dict[int, list]]:
    """Run lm_eval; (the task's metrics, doc_id -> its filtered responses) from its results and samples files."""
    cmd = [LMEVAL, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", task,
           "--include_path", str(tasks), "--log_samples", "--output_path", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **OFFLINE, "HF_HOME": str(out / "hf")})
    failures = [line for line in done.stderr.splitlines() if "API request failed" in line][:3]
    assert done.returncode == 0, f"lm_eval failed ({done.returncode}):\n" + "\n".join(failures or [done.stderr[-4000:]])
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"][task]
    samples = [json.loads(line) for line in next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]
    return results, {s["doc_id"]: s["filtered_resps"] for s in samples}


def served(server, model_dir, model: str, api: str) -> str:
    return (f"model={model},base_url={server.base_url}/v1/{api},tokenizer={model_dir},num_concurrent=2,"
            "max_retries=1,timeout=120")


@pytest.fixture(scope="module")
def hf_choices(model_dir, tasks, tmp_path_factory):
    return lm_eval(tmp_path_factory.mktemp("hf-mc"), tasks, "rolemrc_mc", "hf",
                   f"pretrained={model_dir},dtype=float32", "--batch_size", "4")


@pytest.fixture(scope="module")
def hf_generations(model_dir, tasks, tmp_path_factory):
    return lm_eval(tmp_path_factory.mktemp("hf-gen"), tasks, "rolemrc_gen", "hf",
                   f"pretrained={model_dir},dtype=float32", "--apply_chat_template")[1]


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
def test_lm_eval_loglikelihoods_equal_its_hf_backend(server, model_dir, tasks, hf_choices, engine, tmp_path):
    hf_metrics, hf_docs = hf_choices
    metrics, docs = lm_eval(tmp_path, tasks, "rolemrc_mc", "local-completions",
                            served(server, model_dir, engine, "completions"), "--batch_size", "4")
    assert docs.keys() == hf_docs.keys() == set(range(12))
    ours = torch.tensor([float(ll) for i in sorted(docs) for ll, _ in docs[i]], dtype=torch.float64)
    reference = torch.tensor([float(ll) for i in sorted(hf_docs) for ll, _ in hf_docs[i]], dtype=torch.float64)
    assert len(ours) == len(reference) == 48
    assert (ours - reference).abs().max() <= ATOL, f"max |difference| {(ours - reference).abs().max():.3g}"
    assert [g for i in sorted(docs) for _, g in docs[i]] == [g for i in sorted(hf_docs) for _, g in hf_docs[i]]
    assert metrics["acc,none"] == hf_metrics["acc,none"]


@pytest.mark.parametrize("engine", ENGINES)
def test_lm_eval_chat_generations_equal_greedy(server, model_dir, tasks, hf_generations, engine, tmp_path):
    _, docs = lm_eval(tmp_path, tasks, "rolemrc_gen", "local-chat-completions",
                      served(server, model_dir, engine, "chat/completions"), "--apply_chat_template")
    assert docs == hf_generations
    assert sum(len(r[0]) > 0 for r in docs.values()) >= 3   # not all empty: greedy text to compare


@pytest.mark.parametrize("engine", ENGINES)
def test_guidellm_concurrency_profile_has_no_failures(server, model_dir, engine, tmp_path):
    report = tmp_path / "guidellm.json"
    cmd = [GUIDELLM, "-m", "guidellm", "run", "--backend", f"kind=openai_http,target={server.base_url},model={engine}",
           "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=16",
           "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=32",
           "--tokenizer", f"kind=hf_auto,model={model_dir}", "--output", f"kind=json,path={report}",
           "--disable-console-interactive"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, **OFFLINE, "HF_HOME": str(tmp_path / "hf")})
    assert done.returncode == 0, f"guidellm failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    metrics = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    assert metrics["request_totals"] == {"successful": 16, "errored": 0, "incomplete": 0, "total": 16}
    assert metrics["output_token_count"]["successful"]["total_sum"] == 16 * 32   # each its 32 tokens
