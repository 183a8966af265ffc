"""`rolemrc bench <name>`: benchmarks that print JSON (ratios measured side by side in one run)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import typer

from rolemrc.core.cli import choice, cli_app
from rolemrc.core.extras import needs
from rolemrc.core.placement import Dtype

app = cli_app(help="Benchmarks; each prints JSON and can write it to --out.")
Size = choice(("demo", "medium", "large"))   # the keys of bench.common.SIZES (which imports torch)
Index = choice(("flat", "ivf"))   # datagen.retrieval.build_index's kinds


DEVICE = typer.Option("auto", help="cpu, cuda, cuda:1, ... (auto: cuda if available)")


def concrete(device: str) -> str:
    """'auto' as the device it means here (the benchmarks record and move tensors to a concrete one)."""
    from rolemrc.core.modeling import resolve_device

    return str(resolve_device(device))


def concurrency_list(text: str) -> tuple[int, ...]:
    """`--concurrency 1,8,32` as integers >= 1 (an InputError otherwise)."""
    from rolemrc.core.errors import InputError

    if not re.fullmatch(r"\s*[1-9]\d*\s*(,\s*[1-9]\d*\s*)*", text):
        raise InputError(f"--concurrency {text}: give a comma list of integers >= 1, e.g. 1,8,32")
    return tuple(int(c) for c in text.split(","))


def emit(result: dict, out: Path | None) -> None:
    text = json.dumps(result, indent=1)
    typer.echo(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


MIN_SECONDS_OPTION = typer.Option(1.0, min=0.0, help="each timed run lasts at least this long (a quick variant is "
                                  "run several times per round); ratios are medians over rounds with their min-max")


@app.command("probe")
def probe_cmd(
    prompts: int = typer.Option(256, help="cases per run (N; memory is also measured at 4N)"),
    length: int = typer.Option(64, help="tokens per prompt"),
    batch_size: int = typer.Option(16),
    repeats: int = typer.Option(3, help="interleaved timed repeats of forward and collect (median)"),
    sizes: str = typer.Option("demo,large", help="comma list of: demo, medium, large"),
    device: str = DEVICE,
    nproc: int = typer.Option(1, min=1, help="also time collection in this many processes (torchrun) against one, "
                                             "CPU threads split evenly"),
    min_seconds: float = MIN_SECONDS_OPTION,
    out: Path = typer.Option(None, "--json", help="also write the JSON here"),
) -> None:
    """Collect vs plain forward, vs the RoleMRC-code approach, and memory at N vs 4N."""
    from rolemrc.bench.probe import run

    emit(run(prompts, length, batch_size, repeats, tuple(sizes.split(",")), concrete(device), nproc=nproc,
             min_seconds=min_seconds), out)


@app.command("retrieval")
@needs("datagen", "minilm")
def retrieval_cmd(
    profiles: int = typer.Option(10_200, help="profile (query) vectors"),
    triplets: int = typer.Option(808_700, help="triplet (key) vectors"),
    dim: int = typer.Option(384),
    index: Index = typer.Option("flat", help="flat: exact; ivf: also time the faiss IVF path and its recall@1"),
    seed: int = typer.Option(0),
    query_block: int = typer.Option(None, help="queries per score block of the one-pass search (default: datagen's)"),
    key_block: int = typer.Option(None, help="keys per score block of the one-pass search (default: datagen's)"),
    nlist: int = typer.Option(0, help="with --index ivf: inverted lists (0: about sqrt(triplets))"),
    nprobe: int = typer.Option(8, help="with --index ivf: lists probed per query"),
    rounds: int = typer.Option(5, "--slices", help="query slices the measurements take turns on (evens out changes in "
                                                   "machine load)"),
    out: Path = typer.Option(None, "--json", help="also write the JSON here"),
) -> None:
    """Exact one-pass search (both ends) vs one faiss exact top-1 search, vs the matmul rate; exactness checked."""
    from rolemrc.bench.retrieval import run
    from rolemrc.datagen.retrieval import KEY_BLOCK, QUERY_BLOCK

    emit(run(profiles, triplets, dim, kind=index, seed=seed, query_block=query_block or QUERY_BLOCK,
             key_block=key_block or KEY_BLOCK, nlist=nlist, nprobe=nprobe, rounds=rounds), out)


@app.command("datagen")
@needs("datagen")
def datagen_cmd(
    base_url: str = typer.Option(None, help="an OpenAI-compatible endpoint, e.g. `rolemrc serve` at http://127.0.0.1:8000/v1 "
                                            "(without it only the template backend runs)"),
    model: str = typer.Option(None, help="the served model id"),
    size: str = typer.Option("tiny", help="tiny | small | medium, or a number of personas"),
    seed: int = typer.Option(0),
    concurrency: int = typer.Option(16, help="requests in flight"),
    timeout: float = typer.Option(300.0, help="seconds per request before it is retried"),
    max_tokens: int = typer.Option(512, "--max-new-tokens", help="completion tokens per request at most"),
    seed_requests: bool = typer.Option(True, help="send attempt k with seed=k (--no-seed-requests for vLLM on CPU)"),
    structured_output: bool = typer.Option(False, "--structured-output", help="profiles via a JSON Schema "
                                           "response_format (vLLM's structured outputs)"),
    mrc: Path = typer.Option(None, help="triplet JSONL or MS MARCO v2.1 JSONL/Parquet (default: bundled)"),
    keep: Path = typer.Option(None, help="write both datagen runs here (template/, openai/; must not hold earlier runs)"),
    out: Path = typer.Option(None, "--json", help="also write the JSON here"),
) -> None:
    """Records per minute and malformed share: the template backend vs a served model, same personas, cold."""
    from rolemrc.bench.datagen import run

    emit(run(base_url, model, size=int(size) if size.isdigit() else size, seed=seed, concurrency=concurrency,
             timeout_s=timeout, max_tokens=max_tokens, seed_requests=seed_requests, structured=structured_output,
             mrc=mrc, keep=keep), out)


@app.command("intervene")
def intervene_cmd(
    prompts: int = typer.Option(256, help="cases per timed pass"),
    length: int = typer.Option(64, help="tokens per prompt"),
    batch_size: int = typer.Option(16),
    repeats: int = typer.Option(7, help="interleaved timed repeats per variant (median)"),
    share: float = typer.Option(0.1, help="share of each layer's mlp.act units restrained"),
    sizes: str = typer.Option("demo,large", help="comma list of: demo, medium, large"),
    device: str = DEVICE,
    min_seconds: float = MIN_SECONDS_OPTION,
    out: Path = typer.Option(None, "--json", help="also write the JSON here"),
) -> None:
    """Forward time under each hooked kind's runtime hook vs without, a batch mixing the kinds vs unrestrained, and
    baked vs original."""
    from rolemrc.bench.intervene import run

    emit(run(prompts, length, batch_size, repeats, share, tuple(sizes.split(",")), concrete(device),
             min_seconds=min_seconds), out)


@app.command("serve")
@needs("serve", "eval")
def serve_cmd(
    concurrency: str = typer.Option("1,8,32", help="comma list of concurrent requests"),
    tokens: int = typer.Option(None, help="completion tokens per request (ignore_eos; default 32, 64 with --engine)"),
    waves: int = typer.Option(2, help="requests per run = concurrency x waves"),
    repeats: int = typer.Option(None, help="interleaved repeats (median; default 3, 1 with --engine)"),
    size: Size = typer.Option("demo", help="model size"),
    engine: str = typer.Option(None, help="comma list of vllm, transformers: benchmark a real server over HTTP "
                                          "(unrestrained, one restraint, a mix of 4) instead of the in-process engine"),
    model: Path = typer.Option(None, help="with --engine: a local model directory (default: a random-init --size model)"),
    units: int = typer.Option(None, help="with --engine: units per layer of each restraint (default: 10% of the MLP "
                                         "width; vLLM's LoRA rank follows it)"),
    dtype: Dtype = typer.Option(None, help="with --engine: the served dtype (default float32; auto: the checkpoint's "
                                           "own)"),
    device: str = DEVICE,
    out: Path = typer.Option(None, "--json", help="also write the JSON here"),
) -> None:
    """Engine tokens/s: batched vs naive sequential generate, restrained and baked vs unrestrained; with --engine,
    each engine over HTTP, restrained vs unrestrained and vLLM vs transformers."""
    from rolemrc.bench.serve import run, run_http
    from rolemrc.core.errors import InputError

    concurrencies = concurrency_list(concurrency)
    if engine:
        emit(run_http(tuple(e.strip() for e in engine.split(",")), model, concurrencies, tokens or 64, waves,
                      repeats or 1, size, units=units, dtype=dtype or "float32", device=concrete(device)), out)
    elif model or units or dtype:
        raise InputError("--model, --units and --dtype apply to the HTTP benchmark; name the engine(s) with --engine")
    else:
        emit(run(concurrencies, tokens or 32, waves, repeats or 3, size, device=concrete(device)), out)


@app.command("attacks")
@needs("serve")
def attacks_cmd(
    model: Path = typer.Option(None, help="a local model directory to serve (default: a random-init demo Llama)"),
    base_url: str = typer.Option(None, help="attack this running server instead (its keys KEY1 and KEY2, an "
                                            "experiment 'attacks'; no RSS without its pid)"),
    served_model: str = typer.Option(None, help="with --base-url: the model id (default: the first it lists)"),
    context: int = typer.Option(None, help="the served model's context window (default: its config's, or 2048)"),
    max_queue: int = typer.Option(128, min=2, help="the server's max_queue; the flood sends this many requests"),
    timeout: float = typer.Option(30.0, help="client timeout per attack, seconds"),
    rss_cap_mb: float = typer.Option(2048.0, help="kill the server when an attack grows its RSS past this"),
    only: str = typer.Option(None, help="comma list of attacks to run (default: all)"),
    out: Path = typer.Option(None, "--json", help="also write the JSON here"),
) -> None:
    """Each hostile request of issue 44 sent once to a real server while a stream runs: status, code, seconds to
    answer, server RSS growth, the stream's inter-token gaps against its baseline."""
    from rolemrc.bench.attacks import run

    emit(run(model, base_url, served_model, context, max_queue, timeout, rss_cap_mb,
             only=tuple(a.strip() for a in only.split(",")) if only else ()), out)


@app.command("generate")
def generate_cmd(
    size: list[str] = typer.Option(["demo", "smollm2"], "--size", help="repeatable or a comma list of: demo, smollm2 "
                                   "(the pulled smollm2-135m-instruct; skipped with a note when not pulled), and on "
                                   "a GPU llama-1b, llama-8b (random-init, built on the device)"),
    concurrency: str = typer.Option("1,8,32", help="comma list of requests in flight (max_batch of the engine, rows "
                                                   "of a static batch)"),
    tokens: int = typer.Option(None, help="completion tokens per request at most (ignore_eos; default 64 on CUDA, 32 "
                                          "on the CPU)"),
    prompt_tokens: int = typer.Option(64, help="prompt tokens per request (varied: 1/4 to 2x this)"),
    waves: int = typer.Option(2, help="requests per run = concurrency x waves, all queued at start"),
    repeats: int = typer.Option(None, help="interleaved timed repeats after one warm-up (median; default 3, 1 on "
                                           "CUDA)"),
    device: str = DEVICE,
    dtype: Dtype = typer.Option("auto", help="auto: the checkpoint's own; bfloat16 for the GPU shapes"),
    out: Path = typer.Option(None, "--json", help="also write the JSON here"),
) -> None:
    """Completion tokens/s of the generation engine (unrestrained, one restraint, a mix of 4) against HF `generate`
    on static batches and transformers' `generate_batch`, fixed and varied workloads, side by side in one run."""
    from rolemrc.bench.generate import run

    sizes = tuple(s.strip() for entry in size for s in entry.split(",") if s.strip())
    emit(run(sizes, concurrency_list(concurrency), tokens, waves, repeats, prompt_tokens, concrete(device), dtype), out)


@app.command("clients")
@needs("serve")
def clients_cmd(
    model: Path = typer.Option(..., help="a local model directory (with a chat template), e.g. "
                                         "~/.cache/rolemrc/models/smollm2-135m-instruct after `rolemrc models pull smollm2`"),
    engine: str = typer.Option("transformers,vllm", help="comma list of transformers, vllm"),
    streams: int = typer.Option(4, min=1, help="guidellm's concurrent streams"),
    requests: int = typer.Option(16, min=1, help="guidellm's requests"),
    out: Path = typer.Option(None, "--json", help="also write the JSON here"),
) -> None:
    """lm-eval (log-likelihoods and accuracy vs its hf backend, chat generations) and guidellm (tokens/s, failures)
    against a real `rolemrc serve` per engine; needs ROLEMRC_LMEVAL_PYTHON and ROLEMRC_GUIDELLM_PYTHON."""
    from rolemrc.bench.clients import run

    emit(run(model, tuple(e.strip() for e in engine.split(",")), streams, requests), out)


@app.command("all")
@needs("eval", "datagen", "serve", "minilm")
def all_cmd(
    out: Path = typer.Option(Path("runs/bench"), help="folder for one JSON per benchmark"),
    device: str = typer.Option("auto", help="cpu, cuda, cuda:1, ... (auto: cuda if available; retrieval always runs on "
                                            "the CPU)"),
) -> None:
    """Every benchmark at its default settings (tens of minutes on 2 CPU cores); one JSON file each."""
    from rolemrc.bench import generate, intervene, probe, retrieval, serve

    device = concrete(device)
    runs = {"probe": lambda: probe.run(device=device), "intervene": lambda: intervene.run(device=device),
            "serve": lambda: serve.run(device=device), "generate": lambda: generate.run(device=device),
            "retrieval": retrieval.run}
    for name, run in runs.items():
        typer.echo(f"== bench {name}", err=True)
        emit(run(), out / f"{name}.json")
