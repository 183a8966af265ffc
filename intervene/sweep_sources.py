"""Where a sweep's responses come from: the model loaded in this process (restraints as runtime hooks, rows with
different restraints sharing batches), any OpenAI-compatible `rolemrc serve` endpoint (each row's restraint sent
inline), or a `rolemrc serve` with the vLLM engine started for the sweep (restraints become LoRA adapters)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rolemrc.intervene.spec import Restraint, RestraintError

Rows = Callable[[list[dict], list[Restraint | None]], list[dict]]   # (records, restraint per record) -> responses


def engine_label(config: Any) -> str:
    """What the responses depend on besides model, data and length (part of every cell id)."""
    return f"endpoint:{config.served_model or ''}" if config.base_url else config.engine


def served_model(base_url: str, api_key: str) -> str:
    """The one unrestrained model an endpoint lists (ids without '+restraint'); an error names them otherwise."""
    import openai

    try:
        ids = [m.id for m in openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=2).models.list()]
    except openai.OpenAIError as exc:
        raise RestraintError(f"--base-url {base_url}: cannot list its models: {exc}") from None
    roots = [i for i in ids if "+" not in i]
    if len(roots) != 1:
        raise RestraintError(f"--base-url {base_url} serves {roots or 'no models'}; choose one with --served-model")
    return roots[0]


def vllm_server_config(config: Any, cells: list[Any]) -> dict[str, Any]:
    """A `rolemrc serve` config serving the sweep's model on vLLM, sized for its largest cell and its passes."""
    from pathlib import Path

    from rolemrc.intervene.lora import lora_rank

    widest = max((len(u) for c in cells if c.restraint for u in c.restraint.units.values()), default=1)
    largest = max((c.restraint.num_units for c in cells if c.restraint), default=1)
    slots = max(2, config.cells_per_pass)
    model = {"engine": "vllm", "path": str(Path(config.model).resolve()), "max_lora_rank": lora_rank(widest),
             "max_loras": slots, "max_inline_adapters": slots, "memory_utilization": config.vllm_memory}
    return {"models": {"sweep": model}, "allow_inline_restraints": True, "max_inline_units": largest, "db": None,
            "max_new_tokens": config.max_new_tokens, "max_batch": config.batch_size}


@contextmanager
def row_source(config: Any, cells: list[Any], model: Any, tok: Any, *, progress: bool = True) -> Iterator[Rows]:
    """Yields the function that generates a pass. `model`/`tok`: the loaded model (used only by the in-process
    engine; the caller may drop it afterwards)."""
    import importlib
    import os

    from rolemrc.eval.generate import GenerateConfig

    common = {"max_new_tokens": config.max_new_tokens, "progress": progress}
    if config.base_url is None and config.engine == "transformers":
        gen = GenerateConfig(model=config.model, batch_size=config.batch_size, **common)

        def local(records: list[dict], restraints: list[Restraint | None]) -> list[dict]:
            module = importlib.import_module("rolemrc.eval.generate")   # looked up per call, so tests can wrap it
            return module.generate_rows(model, tok, records, restraints, gen)

        yield local
        return
    server = None
    if config.base_url is None:   # engine vllm: a rolemrc server of our own
        from rolemrc.serve.launch import start_server, stop_server

        server = start_server(vllm_server_config(config, cells), workdir=config.out, timeout=900)
    try:
        base_url = config.base_url or f"{server.base_url}/v1"
        api_key = os.environ.get(config.api_key_env) or "EMPTY"
        name = config.served_model or served_model(base_url, api_key)
        gen = GenerateConfig(model=name, base_url=base_url, concurrency=config.concurrency,
                             api_key_env=config.api_key_env, **common)

        def remote(records: list[dict], restraints: list[Restraint | None]) -> list[dict]:
            from rolemrc.eval.generate import generate_endpoint_rows

            return generate_endpoint_rows(records, restraints, gen)

        yield remote
    finally:
        if server is not None:
            stop_server(server)
