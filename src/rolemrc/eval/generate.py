"""Generation: responses for a test set from a local model (a directory, a pulled model or a hub id; on the generation
engine, greedy by default, chat template, optional restraint per row) or from any OpenAI-compatible endpoint
(`core.openai_client`: concurrency limit, retries with backoff; `extra_body`). Output records keep `question` and
`reference` so scoring can be rerun without regenerating."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from tqdm.auto import tqdm

from rolemrc.core.errors import InputError, RolemrcError
from rolemrc.core.io import write_jsonl
from rolemrc.core.placement import DeviceMap, Dtype, check_dtype, check_placement
from rolemrc.core.records import normalize_record, read_records

# the text a teacher-forced measure (eval.divergence) scores after each prompt: a model's greedy reply or the reference
Continuation = Literal["sft", "dpo", "reference"]
CONTINUATIONS: tuple[str, ...] = get_args(Continuation)


class GenerationError(RolemrcError, RuntimeError):
    """The model or endpoint could not produce responses."""


@dataclass
class GenerateConfig:
    """Where responses come from: `model` is a model name (a local HF directory, a pulled model's name or a hub id
    `org/name[@revision]`, resolved to `model_dir` when the config is made), or a model id when `base_url` is set."""

    model: str = ""
    base_url: str | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0           # 0: greedy
    batch_size: int = 32               # local: rows decoding together
    dtype: Dtype = "auto"              # local; auto: the checkpoint's own
    device: str = "auto"               # local
    device_map: DeviceMap | None = None  # local: place the layers over the GPUs instead of `device`
    restraint: Any = None              # local: a Restraint, spec dict, or YAML/JSON path
    strict: bool = False               # local: refuse a restraint selected on another model (default: a warning)
    api_key_env: str = "OPENAI_API_KEY"
    concurrency: int = 8               # endpoint
    max_retries: int = 4               # endpoint: retries on 429/5xx/timeouts/dropped connections
    backoff_s: float = 0.5
    timeout_s: float = 120.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    model_dir: Path | None = field(default=None, init=False)   # where a local model resolved to

    def __post_init__(self) -> None:
        if not self.model:
            raise InputError("generate needs a model (a local HF directory, or a model id with base_url)")
        if self.max_new_tokens < 1:
            raise InputError("max_new_tokens must be at least 1")
        check_dtype(self.dtype)
        check_placement(self.device, self.device_map)
        if self.restraint is not None and self.base_url:
            raise InputError("a restraint applies to local models; for an endpoint pass it in extra_body "
                             "({'restraint': ...}) as rolemrc serve expects")
        if not self.base_url:
            from rolemrc.core.modeling import resolve_model

            self.model_dir = resolve_model(self.model)


def _with_response(record: dict, response: str, latency: float, tokens: int, **extra) -> dict:
    out = {"id": record["id"], "task": record.get("task"), "question": record["question"],
           "reference": record["reference"], "response": response, "latency": latency, "tokens": tokens,
           "fields": record["fields"]}
    return out | extra


def generate(data: list[dict[str, Any]] | str | os.PathLike, config: GenerateConfig | None = None, *,
             out: str | os.PathLike | None = None, **options) -> list[dict[str, Any]]:
    """Responses for test records (`id`, `question`, `reference`, `task`, or their aliases: core.records) or a
    test JSONL path.

    `config` or keyword options (GenerateConfig fields, e.g. model="runs/dpo", base_url=..., restraint=...).
    Each result: id, task, question, reference, response, latency (s), tokens (generated), fields (the source
    fields of turns, reference and id). Written to
    `out` (JSONL) when given."""
    config = config or GenerateConfig(**options)
    if isinstance(data, list):
        records = [normalize_record(r, k + 1, "test", where=f"test record {k}")[0] for k, r in enumerate(data)]
    else:
        records = read_records(data, "test")[0]
    if config.base_url:
        results = generate_endpoint_rows(records, [None] * len(records), config)
    else:
        results = _generate_local(records, config)
    if out is not None:
        write_jsonl(out, results)
    return results


def _generate_local(records: list[dict], config: GenerateConfig) -> list[dict]:
    from rolemrc.core.modeling import load_model

    restraint = None
    if config.restraint is not None:   # read the spec before loading the model
        from rolemrc.intervene.fit import check_origin
        from rolemrc.intervene.spec import as_restraint

        restraint = as_restraint(config.restraint)
        check_origin(restraint, config.model_dir, config.strict)
    model, tok = load_model(config.model_dir, dtype=config.dtype, device=config.device, device_map=config.device_map)
    return generate_rows(model, tok, records, [restraint] * len(records), config)


def generate_rows(model: Any, tok: Any, records: list[dict], restraints: list[Any], config: GenerateConfig) -> list[dict]:
    """Responses of a loaded model for `records`, record i under `restraints[i]` (a Restraint or None), on the
    generation engine (`generate.offline`): up to `batch_size` rows decode together, whatever their restraints."""
    from rolemrc.core.chat import render_chat
    from rolemrc.core.modeling import context_window
    from rolemrc.generate.engine import eos_ids
    from rolemrc.generate.offline import generate as run_engine
    from rolemrc.generate.params import SamplingParams
    from rolemrc.intervene.fit import validate

    limit = context_window(model, tok)
    room = (limit - config.max_new_tokens) if limit else None
    if room is not None and room < 1:
        raise GenerationError(f"max_new_tokens {config.max_new_tokens} leaves no room for a prompt in {limit} positions")
    for r in {id(r): r for r in restraints if r is not None}.values():
        validate(r, model)
    prompts = [tok(render_chat(tok, r["question"]), add_special_tokens=False)["input_ids"] for r in records]
    truncated = [room is not None and len(p) > room for p in prompts]
    prompts = [p[-room:] if cut else p for p, cut in zip(prompts, truncated)]
    params = SamplingParams(max_tokens=config.max_new_tokens, temperature=config.temperature)
    done = run_engine(model, tok, prompts, params, restraints, max_batch=config.batch_size, progress=config.progress)
    ends = eos_ids(model, tok)
    results = []
    for record, completion, cut in zip(records, done, truncated):
        ids = completion.token_ids[:-1] if completion.token_ids[-1:] and completion.token_ids[-1] in ends \
            else completion.token_ids
        results.append(_with_response(record, tok.decode(ids, skip_special_tokens=True).strip(), completion.latency,
                                      len(ids), truncated=cut))
    return results


def generate_endpoint_rows(records: list[dict], restraints: list[Any], config: GenerateConfig) -> list[dict]:
    """Responses of `config.base_url` for `records`, record i under `restraints[i]` (a Restraint, sent inline in
    the request body as `rolemrc serve` expects, or None), all requests in flight together up to the concurrency
    limit, so a server batches rows with different restraints."""
    from rolemrc.eval.judges import run_sync

    bodies = [ab_fields(record, config.extra_body) | ({"restraint": r.to_dict()} if r is not None else {})
              for record, r in zip(records, restraints)]
    return run_sync(_generate_endpoint(records, bodies, config))


def ab_fields(record: dict, body: dict[str, Any]) -> dict[str, Any]:
    """`body`, and when it names an A/B `experiment` (rolemrc serve), the `user` arms are assigned by (the record's
    `user`, else its id) and the `metadata` `ab report` scores with (its task and reference), unless `body` sets them."""
    if "experiment" not in body:
        return body
    metadata = {"task": record.get("task"), "reference": record["reference"]} | (body.get("metadata") or {})
    return {"user": str(record.get("user") or record["id"])} | body | {"metadata": metadata}


async def _generate_endpoint(records: list[dict], bodies: list[dict[str, Any]], config: GenerateConfig) -> list[dict]:
    from rolemrc.core.openai_client import OpenAIClient

    client = OpenAIClient(config.base_url, config.model, temperature=config.temperature, max_tokens=config.max_new_tokens,
                          concurrency=config.concurrency, max_retries=config.max_retries, backoff_s=config.backoff_s,
                          timeout_s=config.timeout_s, api_key_env=config.api_key_env, error=GenerationError)
    bar = tqdm(total=len(records), desc=f"generate ({config.model})", disable=not config.progress)

    async def one(record: dict, body: dict[str, Any]) -> dict:
        reply = await client.create(record["question"], label=record["id"], extra_body=body or None)
        bar.update()
        return _with_response(record, reply.text.strip(), reply.latency, reply.tokens)

    try:
        return list(await asyncio.gather(*(one(r, b) for r, b in zip(records, bodies))))
    finally:
        bar.close()
        await client.aclose()
