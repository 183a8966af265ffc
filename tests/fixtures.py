"""Small deterministic data and models for tests (no network)."""

from __future__ import annotations

import fcntl
import os
import random
from collections.abc import Callable
from pathlib import Path

from rolemrc.core.taxonomy import TASKS

WORDS = ["the", "keeper", "of", "the", "lighthouse", "watched", "storms", "roll", "over", "grey", "water", "while", "ships", "passed", "a", "baker", "in", "the", "old", "quarter", "kneads", "dough", "before", "dawn", "and", "sings", "to", "the", "ovens", "passages", "about", "rivers", "mountains", "trains", "and", "libraries", "answer", "questions", "on", "history", "science", "i", "cannot", "answer", "that", "because", "it", "lies", "outside", "what", "my", "character", "knows", "sorry", "traveller", "please", "reply", "in", "capital", "letters", "with", "an", "emoji", "and", "no", "more", "than", "twenty", "words"]

# a chat on which conftest's `peaked_model` ends its greedy reply with EOS (after 31 tokens of text)
STOPS_ON_EOS = [{"role": "user", "content": "character more that because"}]


def once_per_run(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder `name` in this test run's common temporary folder, filled by `build(folder)` the first time any test
    asks: xdist's workers share that folder (pytest-<n>/), so the first builds under a file lock and the rest wait."""
    base = tmp_path_factory.getbasetemp()
    common = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, done = common / name, common / f"{name}.done"
    with open(common / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            build(folder)
            done.touch()
    return folder


def corpus(n: int = 200, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(n)]


def test_records(n: int = 40, seed: int = 0) -> list[dict]:
    """Test-format records cycling through all 18 task names, with varied lengths and turn counts."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        task = TASKS[i % len(TASKS)]
        turns = [{"role": "System", "content": "You are " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))}]
        for _ in range(rng.randint(1, 2)):
            turns.append({"role": "User", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 25)))})
            turns.append({"role": "Assistant", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 10)))})
        turns.pop()  # end on a user turn
        out.append({"id": f"t{i}", "question": turns, "reference": "a reference answer", "task": task})
    return out


# SmolLM2-135M-Instruct's own chat template: ChatML, a default system turn, no {% generation %} markers
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_diff_file(path, delta, q):
    """A probe diff directory, as `rolemrc probe diff` writes it, for hook mlp.act with one dimension, multi_turn
    (delta [layers, width] and q-values; the standardized effect equals delta, with the same q)."""
    import torch

    from rolemrc.probe.diff import DiffResult

    d = "multi_turn"
    delta, q = delta.float(), q.double()
    result = DiffResult({d: torch.zeros_like(delta)}, {d: delta.clone()}, {d: delta.clone()}, {d: delta.clone()},
                        {d: q.clone()}, {d: q.clone()}, meta={
        "hook": "mlp.act", "layers": str(delta.shape[0]), "width": str(delta.shape[1]), "k": "2", "top_fraction": "0.2",
        "tokens": "last", "rank": "signed", "generation_prompt": "true", "test": "two-proportion-z", "effect_test": "welch-t"},
        cases_a={d: 10}, cases_b={d: 10}, mean_a={d: torch.zeros_like(delta)}, mean_b={d: delta.clone()},
        effect={d: delta.clone()}, effect_t={d: delta.clone()}, effect_p={d: q.clone()}, effect_q={d: q.clone()})
    result.save(path, top_n=8)
    return path


def save_peaked_llama(path, tokenizer, *, seed: int = 3, max_positions: int = 2048):
    """Save a small Llama (hidden 64, 2 layers, 96 MLP units, head dim 32 as vLLM's CPU attention needs) with a
    scaled-up output head, so greedy choices have clear margins across batchings; returns `path`."""
    import torch

    from rolemrc.core.tiny import build_model

    model = build_model("llama", tokenizer, seed=seed, hidden=64, layers=2, intermediate=96, heads=2,
                        max_positions=max_positions)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_sweep_inputs(root, tokenizer, records: int = 6):
    """A sweep's inputs under `root`: the peaked small Llama (model/), a diff ranking its 2 x 96 mlp.act units in a
    seeded random order (diff/), and `records` test records (test.jsonl); returns `root`."""
    import torch

    from rolemrc.core.io import write_jsonl

    save_peaked_llama(root / "model", tokenizer)
    delta = torch.linspace(-1, 1, 2 * 96).reshape(2, 96)[:, torch.randperm(96, generator=torch.Generator().manual_seed(0))]
    write_diff_file(root / "diff", delta, torch.full_like(delta, 0.5))
    write_jsonl(root / "test.jsonl", test_records(records))
    return root


def save_eos_llama(path, tokenizer, texts: list[str], *, share: float = 0.25, seed: int = 5, head_scale: float = 8.0):
    """Save a small Llama (head dim 32, as vLLM's CPU attention needs) whose greedy next token is the EOS token at
    `share` of the positions of `texts`: its EOS output row points along the mean final hidden state, scaled to that
    quantile, so clients meet end-of-sequence often (the other rows are scaled by `head_scale` for clear margins)."""
    import torch

    from rolemrc.core.tiny import build_model

    model = build_model("llama", tokenizer, seed=seed, hidden=64, layers=2, intermediate=96, heads=2)
    eos = tokenizer.eos_token_id
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
        hidden = model.model(**batch).last_hidden_state[batch.attention_mask.bool()]
        direction = hidden.mean(0) / hidden.mean(0).norm()
        others = hidden @ model.lm_head.weight.T
        others[:, eos] = float("-inf")
        along = hidden @ direction
        ratio = torch.where(along > 0, others.max(-1).values / along, torch.inf)   # EOS wins where scale > ratio
        model.lm_head.weight[eos] = direction * ratio.sort().values[int(share * len(ratio))]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


ANSWERABLE_UNITS = [3, 10, 17, 25]      # save_planted_llama's units U, in layer 1's mlp.act (PLANTED_WIDTH wide)
# save_planted_llama's reply with U off: single tokens, none of them in answerable_records' prompts
ANSWER_CHAIN = ("watched", "an", "old", "emoji", "with", "kneads")
PLANTED_WIDTH = 32
ANSWERABLE_TASKS = ("role_unrelated_mrc_refused_no_narration-2ndanswer", "role_unrelated_mrc_refused_with_narration-2ndanswer")
TOPICS = ["lighthouse", "storms", "ships", "baker", "dough", "ovens", "rivers", "mountains", "trains", "libraries",
          "history", "science", "water", "quarter"]


def save_planted_llama(path, tokenizer, *, units_on: bool = True, noise: float = 0.0, noise_seed: int = 0):
    """A Llama whose only working MLP units are UNITS = ANSWERABLE_UNITS (layer 1): they fire on every token (all embeddings share
    dimension 0) and write dimension 1, which the output head turns into the bigram loop "cannot answer cannot
    answer ..." ("cannot" and "answer" also have a dimension of their own). Attention and every other unit write
    nothing, so the next token depends on the current token and UNITS alone, and as the final RMS norm only
    rescales, it is the argmax of head @ residual; with UNITS at 0 a token without a dimension of its own leads to
    "watched", and each ANSWER_CHAIN word (a dimension of its own each, but the last) to the next: "watched an old
    emoji with kneads watched ...", a reply that is no loop (eval.damage) in its first 2 x 6 + 2 words. As no chain
    word is in answerable_records' prompts, a probe of them sees every prompt token as before the chain.
    units_on=False saves that model (UNITS' gate and up rows zero), which answers where the planted one refuses.
    noise: the standard deviation of seeded Gaussian noise added to every MLP weight (the same for a given
    noise_seed), so no two units tie exactly; at 1e-3 it changes no greedy token."""
    import torch

    from rolemrc.core.tiny import build_model

    cannot, answer = tokenizer.convert_tokens_to_ids(["Ġcannot", "Ġanswer"])
    chain = tokenizer.convert_tokens_to_ids([f"Ġ{word}" for word in ANSWER_CHAIN])
    model = build_model("llama", tokenizer, seed=0, hidden=64, layers=2, intermediate=PLANTED_WIDTH, heads=2)
    with torch.no_grad():
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.zero_()
        embed[:, 0] = 1                  # shared by every token: drives UNITS on any input
        embed[cannot, 2] = embed[answer, 3] = 1
        for dim, token in enumerate(chain[:-1], start=4):
            embed[token, dim] = 1
        for layer in model.model.layers:
            for linear in (layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                linear.weight.zero_()
        mlp = model.model.layers[1].mlp
        mlp.gate_proj.weight[ANSWERABLE_UNITS, 0] = mlp.up_proj.weight[ANSWERABLE_UNITS, 0] = float(units_on)
        # normed, a plain token's residual is 8 e0: each unit gives silu(8) * 8 ~ 64, so dimension 1 ~ 2 (~1 on
        # "cannot" and "answer", whose residual norms to 5.7 (e0 + e2|e3))
        mlp.down_proj.weight[1, ANSWERABLE_UNITS] = 0.5 / 64
        gen = torch.Generator().manual_seed(noise_seed)
        for layer in model.model.layers:
            for linear in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                linear.weight.add_(noise * torch.randn(linear.weight.shape, generator=gen))
        head.zero_()
        head[chain[0], 0] = 1                           # wins only while dimension 1 is 0
        for dim, token in enumerate(chain[1:], start=4):
            head[token, dim] = 10                       # after the chain's word before it
        head[cannot, 1], head[cannot, 3] = 6, 10        # first, and after "answer"
        head[answer, 1], head[answer, 2] = 5, 10        # after "cannot"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def answerable_records(n: int, prefix: str = "p") -> list[dict]:
    """Multi-turn items whose second turn must be answered; the reference shares no word with the user turns, so
    any non-empty reply without a refusal cue passes the rules judge and any refusal fails it."""
    system = {"role": "System", "content": "You are the keeper of the lighthouse"}
    return [{"id": f"{prefix}{i}", "task": ANSWERABLE_TASKS[i % 2], "reference": "a reference answer",
             "question": [system, {"role": "User", "content": f"tell me about the {TOPICS[i % len(TOPICS)]}"},
                          {"role": "Assistant", "content": "i cannot say"},
                          {"role": "User", "content": f"please, the {TOPICS[(i + 5) % len(TOPICS)]} matter to me"}]}
            for i in range(n)]


def vllm_or_skip(module_level: bool = True) -> str:
    """The interpreter with vLLM (`make test`'s .venv-vllm), else a skip; with ROLEMRC_REQUIRE_VLLM=1, as `make test`
    sets, a missing vLLM fails instead."""
    import os

    import pytest

    from rolemrc.serve.engines.vllm import vllm_python
    from rolemrc.serve.errors import ServeConfigError

    try:
        return vllm_python("test")
    except ServeConfigError as exc:
        if os.environ.get("ROLEMRC_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(f"vLLM is not installed ({exc})", allow_module_level=module_level)


def served_report(server, experiment: str, **kw) -> dict:
    """The A/B report (`rolemrc.ab.report.build_report`) over the request log of a running server whose config has
    `db: ab.sqlite`: the server only logs, the report is computed here."""
    from rolemrc.ab.report import build_report
    from rolemrc.serve.store import Store

    store = Store.open(str(server.config.parent / "ab.sqlite"))
    try:
        return build_report(store, experiment, **kw)
    finally:
        store.close()


def cache_snapshot(hub: Path, repo: str, source: Path, commit: str, ref: str | None = "main") -> Path:
    """Put the model directory `source` into the HF hub cache `hub` ($HF_HOME/hub) as huggingface_hub lays it out:
    models--org--name/blobs/<sha256> holding the files, snapshots/<commit>/ symlinks to them, refs/<ref> the commit."""
    import hashlib
    import os

    root = hub / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for file in sorted(source.iterdir()):
        if file.is_file():
            data = file.read_bytes()
            blob = root / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    if ref is not None:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snapshot


def postgres_server():
    """Start a throwaway PostgreSQL server (Debian's package: initdb and postgres as the `postgres` user when run as
    root, its data and unix socket in a fresh /tmp folder, a free TCP port); a generator yielding its base URL and
    stopping it after. Skips without PostgreSQL or psycopg, except under ROLEMRC_REQUIRE_POSTGRES=1 (`make test`)."""
    import os
    import shutil
    import subprocess
    import tempfile
    import time

    import pytest

    from rolemrc.serve.launch import die_with_parent, free_port

    bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    try:
        import psycopg
    except ImportError as exc:
        bins, why = [], f"psycopg is not installed ({exc})"
    else:
        why = "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb; scripts/system-deps.sh installs it)"
    if not bins:
        if os.environ.get("ROLEMRC_REQUIRE_POSTGRES") == "1":
            pytest.fail(why)
        pytest.skip(why)
    bindir = bins[-1].parent
    root = Path(tempfile.mkdtemp(prefix="rolemrc-pg-"))
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if as_postgres:
        shutil.chown(root, "postgres", "postgres")
    port = free_port()
    subprocess.run([*as_postgres, str(bindir / "initdb"), "-D", str(root / "data"), "-A", "trust", "-U", "postgres",
                    "--no-sync"], check=True, capture_output=True)
    with open(root / "server.log", "wb") as log:
        proc = subprocess.Popen([*as_postgres, str(bindir / "postgres"), "-D", str(root / "data"), "-k", str(root),
                                 "-p", str(port), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off",
                                 "-c", "max_connections=200"], stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent)   # a killed test run leaves no server behind
    url = f"postgresql://postgres@127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                psycopg.connect(f"{url}/postgres", connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"PostgreSQL did not start:\n{(root / 'server.log').read_text()}") from None
                time.sleep(0.2)
        yield url
    finally:
        # a fast shutdown through pg_ctl (a signal to runuser reaches PostgreSQL as SIGTERM, a smart shutdown that
        # waits for every client to leave)
        subprocess.run([*as_postgres, str(bindir / "pg_ctl"), "stop", "-D", str(root / "data"), "-m", "fast", "-w",
                        "-t", "20"], capture_output=True)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(root, ignore_errors=True)


def postgres_database(server_url: str) -> str:
    """A new, empty database on the server at `server_url`: its URL."""
    import uuid

    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(f"{server_url}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{server_url}/{name}"


# vLLM flags for a test server whose assertions do not depend on torch.compile: it starts in about half the time
EAGER = ["--enforce-eager"]
