"""Where a sweep's responses come from: the model loaded in this process (engine `transformers`: the generation engine
`rolemrc.generate`, restraints as runtime hooks, rows with different restraints sharing batches), any
OpenAI-compatible `rolemrc serve` endpoint (`--base-url`: each row's restraint sent inline), or a `rolemrc serve`
started for the sweep with another engine of serve's registry that runs a local model (`vllm`: restraints become LoRA
adapters)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rolemrc.intervene.spec import Restraint, RestraintError

Rows = Callable[[list[dict], list[Restraint | None]], list[dict]]   # (records, restraint per record) -> responses


IN_PROCESS = "transformers"   # this engine's name runs in this process, not behind a server


# what the sweep sets on its server's model itself: no --engine-options key
SWEEP_SETS = ("path", "max_lora_rank", "max_loras", "max_inline_adapters")


def check_engine(name: str, options: dict[str, Any]) -> None:
    """`name` must be an engine of serve's registry (`serve.engines.ENGINES`) that serves a local model directory;
    `options`, more of that engine's serve options (its `Options` fields, less those the sweep sizes itself)."""
    from dataclasses import fields

    from rolemrc.serve.engines import ENGINES, engine_class
    from rolemrc.serve.errors import ServeConfigError

    if name not in ENGINES:
        raise RestraintError(f"engine: {name!r} is not a serving engine; choose from {', '.join(ENGINES)}")
    known = {f.name for f in fields(engine_class(name).Options)}
    if "path" not in known:
        raise RestraintError(f"engine {name!r} does not run a local model; point --base-url at a running server instead")
    if not isinstance(options, dict):
        raise RestraintError(f"--engine-options must be a JSON object, not {options!r}")
    allowed = sorted(known - set(SWEEP_SETS))
    if unknown := sorted(set(options) - set(allowed)):
        raise RestraintError(f"--engine-options {', '.join(unknown)}: not a {name} engine option the sweep leaves "
                             f"to you; choose from {', '.join(allowed)}")
    try:   # the values too, as the server would check them, before any model loads
        engine_class(name).Options(path=".", **options)
    except ServeConfigError as exc:
        raise RestraintError(f"--engine-options: {exc}") from None


def check_rank(config: Any, cells: list[Any]) -> None:
    """A sweep on a local engine that applies restraints as LoRA adapters (`max_lora_rank` among its options: vLLM)
    must fit every cell's widest layer in the largest rank that engine accepts; a RestraintError naming the cell."""
    from dataclasses import fields

    from rolemrc.intervene.lora import VLLM_RANKS, lora_units
    from rolemrc.serve.engines import engine_class

    if config.base_url or config.engine == IN_PROCESS:
        return
    if "max_lora_rank" not in {f.name for f in fields(engine_class(config.engine).Options)}:
        return
    for cell in cells:
        if cell.restraint is not None and lora_units(cell.restraint) > VLLM_RANKS[-1]:
            raise RestraintError(f"--engine {config.engine}: cell {cell.id} restrains {lora_units(cell.restraint)} "
                                 f"units in one layer, over the largest LoRA rank vLLM accepts ({VLLM_RANKS[-1]}); "
                                 "sweep it with --engine transformers, then serve the cells you choose baked "
                                 "(`rolemrc ab bake`)")


def engine_label(config: Any) -> str:
    """What the responses depend on besides model, data and length (part of every cell id): any engine option may
    (a dtype, a vLLM flag), so all of them count."""
    if config.base_url:
        return f"endpoint:{config.served_model or ''}"
    return config.engine + (json.dumps(config.engine_options, sort_keys=True) if config.engine_options else "")


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


def server_config(config: Any, cells: list[Any]) -> dict[str, Any]:
    """A `rolemrc serve` config serving the sweep's model on `config.engine`, sized for its largest cell and its
    passes (the sizing options that engine's `Options` has: LoRA rank and slots), with `config.engine_options`."""
    from dataclasses import fields

    from rolemrc.core.modeling import resolve_model
    from rolemrc.intervene.lora import lora_rank
    from rolemrc.serve.engines import engine_class

    widest = max((len(u) for c in cells if c.restraint for u in c.restraint.units.values()), default=1)
    largest = max((c.restraint.num_units for c in cells if c.restraint), default=1)
    slots = max(2, config.cells_per_pass)
    sizing = {"max_lora_rank": lora_rank(widest), "max_loras": slots, "max_inline_adapters": slots}
    options = {f.name for f in fields(engine_class(config.engine).Options)}
    model = {"engine": config.engine, "path": str(resolve_model(config.model).resolve()),
             **{k: v for k, v in sizing.items() if k in options}, **config.engine_options}
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
    if config.base_url is None and config.engine == IN_PROCESS:
        gen = GenerateConfig(model=config.model, batch_size=config.batch_size, **common)

        def local(records: list[dict], restraints: list[Restraint | None]) -> list[dict]:
            module = importlib.import_module("rolemrc.eval.generate")   # looked up per call, so tests can wrap it
            return module.generate_rows(model, tok, records, restraints, gen)

        yield local
        return
    server = None
    if config.base_url is None:   # a rolemrc server of our own
        from rolemrc.serve.launch import start_server, stop_server

        server = start_server(server_config(config, cells), workdir=config.out, timeout=900)
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
