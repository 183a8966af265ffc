"""The demo's serve stage: the DPO model and its restraint behind `rolemrc serve`, called with the openai client,
on the transformers engine and, where vLLM is installed, on the vLLM engine (the restraint as a LoRA adapter)."""

from __future__ import annotations

import json
from pathlib import Path

from rolemrc.core.stages import StageCache
from rolemrc.demo.config import DemoConfig

QUESTIONS = 4      # test prompts asked of every variant
MAX_TOKENS = 48
VLLM_MEMORY = 0.15   # of the machine's memory on CPU (KV cache + weights); 4 short requests need far less than 0.3


def vllm_missing() -> str | None:
    """Why the vLLM engine cannot run here (None when it can)."""
    from rolemrc.serve.engines.vllm import vllm_python
    from rolemrc.serve.errors import ServeConfigError

    try:
        vllm_python("dpo-vllm")
    except ServeConfigError as exc:
        return str(exc)
    return None


def serve_config(dpo: Path, baked: Path, restraint: str, spec: Path, out: Path, vllm: bool) -> dict:
    models = {"dpo": {"path": str(dpo.resolve())}, "dpo-restrained": {"path": str(baked.resolve())}}
    if vllm:
        models["dpo-vllm"] = {"engine": "vllm", "path": str(dpo.resolve()), "memory_utilization": VLLM_MEMORY,
                              "vllm_args": ["--enforce-eager"]}   # no torch.compile or graph capture for 4 questions
    return {"models": models, "restraints": {restraint: str(spec.resolve())}, "db": str((out / "ab.sqlite").resolve())}


def variants(restraint: str, vllm: bool) -> dict[str, tuple[str, dict]]:
    """label -> (model id, extra_body) of every variant asked."""
    calls = {"dpo": ("dpo", {}), f"dpo+{restraint}": (f"dpo+{restraint}", {}), "dpo-restrained": ("dpo-restrained", {}),
             "dpo (extra_body restraint)": ("dpo", {"restraint": restraint})}
    if vllm:
        calls |= {"dpo-vllm": ("dpo-vllm", {}), f"dpo-vllm+{restraint}": (f"dpo-vllm+{restraint}", {})}
    return calls


def agreement(answers: dict[str, list[str]], pairs: list[tuple[str, str]]) -> dict[str, str]:
    """'k/n' greedy replies equal between the two variants of each pair."""
    return {f"{a} == {b}": f"{sum(x == y for x, y in zip(answers[a], answers[b]))}/{len(answers[a])}" for a, b in pairs}


def serve_stage(cache: StageCache, cfg: DemoConfig, dpo: Path, spec: Path, baked: Path, test: Path) -> dict:
    """Serve the DPO model with its registered restraint and the baked copy; ask every variant the first test
    questions (greedy), and count where the runtime hook, the baked weights and vLLM's LoRA adapter agree."""
    import openai

    from rolemrc.core.io import read_jsonl
    from rolemrc.core.records import prompt_turns
    from rolemrc.intervene import Restraint
    from rolemrc.serve.errors import ServeConfigError
    from rolemrc.serve.launch import running_server

    out = cfg.out / "serve"
    name = Restraint.load(spec).name
    missing = vllm_missing() if cfg.vllm is not False else "--no-vllm"
    if cfg.vllm and missing:
        raise ServeConfigError(f"--vllm: {missing}")
    config = serve_config(dpo, baked, name, spec, out, vllm=missing is None)
    calls = variants(name, vllm=missing is None)

    def run() -> dict:
        out.mkdir(parents=True, exist_ok=True)
        prompts = [prompt_turns(r) for r in read_jsonl(test)[:QUESTIONS]]
        with running_server(config, workdir=out) as server:
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="demo")
            models = [m.id for m in client.models.list().data]
            answers = {label: [client.chat.completions.create(
                model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                extra_body=body or None).choices[0].message.content for messages in prompts]
                for label, (model, body) in calls.items()}
        pairs = [(f"dpo+{name}", "dpo-restrained"), (f"dpo+{name}", "dpo (extra_body restraint)")]
        if missing is None:
            pairs += [("dpo-vllm", "dpo"), (f"dpo-vllm+{name}", f"dpo+{name}")]
        result = {"base_url": server.base_url, "models": models, "question": prompts[0][-1]["content"],
                  "replies": {label: replies[0] for label, replies in answers.items()},
                  "agreement": agreement(answers, pairs),
                  "hook_equals_baked": answers[f"dpo+{name}"] == answers["dpo-restrained"],
                  "vllm": "served the restraint as a LoRA adapter" if missing is None else f"skipped: {missing}"}
        (out / "calls.json").write_text(json.dumps(result, indent=1))
        return result

    return cache.run("serve", {"dpo": dpo, "spec": spec, "baked": baked, "engines": sorted(
        {m.get("engine", "transformers") for m in config["models"].values()})}, run, [out / "calls.json"])
