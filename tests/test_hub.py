"""Model names: a local directory, a model pulled by `rolemrc models pull`, or a hub id `org/name[@revision]` resolved
through huggingface_hub, the HF cache first. Offline (HF_HUB_OFFLINE=1) against a hub cache laid out in a temporary
HF_HOME as huggingface_hub writes one (blobs, snapshots of symlinks, refs), through the library, the CLI and a server
over HTTP; an id neither cached nor reachable is one `error:` line, exit 2, before anything is read or loaded."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
from fixtures import cache_snapshot
from fixtures import test_records as records_of
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.errors import EXIT_INPUT
from rolemrc.core.hub import HubModelError, parse_hub_id
from rolemrc.core.io import write_jsonl
from rolemrc.core.modeling import ModelDirError, dir_fingerprint, resolve_model

MAIN, V2 = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, model_dirs, tokenizer) -> Path:
    """An HF_HOME whose hub cache holds org/tiny: main = the llama fixture, refs/v2 = a llama of other weights."""
    from rolemrc.core.tiny import build_model

    home = tmp_path_factory.mktemp("hf-home")
    other = tmp_path_factory.mktemp("other-llama")
    build_model("llama", tokenizer, seed=9, hidden=64, layers=2, intermediate=96).save_pretrained(other)
    tokenizer.save_pretrained(other)
    cache_snapshot(home / "hub", "org/tiny", model_dirs["llama"], MAIN)
    cache_snapshot(home / "hub", "org/tiny", other, V2, ref="v2")
    return home


@pytest.fixture
def offline(hf_home, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hf_home


def snapshot(home: Path, commit: str) -> Path:
    return home / "hub" / "models--org--tiny" / "snapshots" / commit


def test_hub_ids_resolve_to_their_snapshots_offline(offline, model_dirs):
    assert resolve_model("org/tiny") == snapshot(offline, MAIN)
    assert resolve_model("org/tiny@v2") == resolve_model(f"org/tiny@{V2}") == snapshot(offline, V2)
    assert resolve_model(Path("org/tiny")) == snapshot(offline, MAIN)   # a CLI's Path option carries ids too
    # the snapshot's files are symlinks into blobs/: its fingerprint is the source directory's
    assert dir_fingerprint("org/tiny") == dir_fingerprint(snapshot(offline, MAIN)) == dir_fingerprint(model_dirs["llama"])
    assert dir_fingerprint("org/tiny@v2") != dir_fingerprint("org/tiny")


def test_names_that_do_not_resolve_say_why(offline, tmp_path, monkeypatch):
    with pytest.raises(HubModelError, match=r"org/absent: not a local directory; as a hub id, not in the HF cache at "
                                            rf"{offline / 'hub'} and HF_HUB_OFFLINE is set"):
        resolve_model("org/absent")
    with pytest.raises(HubModelError, match="org/tiny@nope: .*not in the HF cache"):
        resolve_model("org/tiny@nope")
    with pytest.raises(HubModelError, match="not a hub id"):
        resolve_model("org/na me")
    with pytest.raises(ModelDirError, match="no such directory$"):
        resolve_model("./runs/sft")   # a path: as before
    with pytest.raises(ModelDirError, match="no such directory$"):
        resolve_model(tmp_path / "a" / "b")
    monkeypatch.setenv("ROLEMRC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelDirError, match=r"smol: no such directory, and no model of that name pulled into "):
        resolve_model("smol")
    assert parse_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct@main").revision == "main"


def test_a_pulled_models_name_resolves_to_its_folder(tmp_path, monkeypatch, model_dirs):
    import shutil

    monkeypatch.setenv("ROLEMRC_CACHE", str(tmp_path))
    shutil.copytree(model_dirs["llama"], tmp_path / "models" / "tiny-pulled")
    assert resolve_model("tiny-pulled") == tmp_path / "models" / "tiny-pulled"


def test_an_unreachable_hub_is_named(hf_home, monkeypatch):
    """Not offline, not cached, and the hub's address refuses connections: one error naming the id."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(HubModelError, match="org/absent: not a local directory; as a hub id, not in the HF cache at .* "
                                            "and the hub could not be reached"):
        resolve_model("org/absent")


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_probe_collect_records_the_id_and_its_snapshot(offline, tmp_path):
    from rolemrc.probe.paired import load_probe

    data = tmp_path / "test.jsonl"
    write_jsonl(data, records_of(6))
    result = invoke("probe", "collect", "--model", "org/tiny", "--model", "org/tiny@v2", "--data", data,
                    "--out", tmp_path / "p.safetensors")
    assert result.exit_code == 0, result.output
    probe = load_probe(tmp_path / "p.safetensors")
    assert [c.meta["model"] for c in probe.counts] == ["org/tiny", "org/tiny@v2"]
    assert [c.meta["model_dir"] for c in probe.counts] == [str(snapshot(offline, MAIN)), str(snapshot(offline, V2))]
    assert probe.counts[0].meta["dtype"] == "float32"   # auto: the fixture's checkpoint is float32


def test_an_uncached_id_is_one_error_before_the_data_is_read(offline, tmp_path):
    for args in (["probe", "collect", "--model", "org/absent", "--data", tmp_path / "none.jsonl", "--out", tmp_path / "p"],
                 ["probe", "attribute", "--model", "org/tiny", "--model", "org/absent", "--pairs", tmp_path / "none.jsonl",
                  "--out", tmp_path / "a"]):
        result = invoke(*args)
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert result.exit_code == EXIT_INPUT and len(errors) == 1, result.output
        assert errors[0].startswith("error: org/absent: not a local directory") and "none.jsonl" not in errors[0]
    # eval (like train) reads its data first: a name that resolves on the hub may download a whole model
    result = invoke("eval", "run", "--model", "org/absent", "--data", tmp_path / "none.jsonl", "--out", tmp_path / "r")
    assert result.exit_code == EXIT_INPUT and "none.jsonl: no such file" in result.output
    (tmp_path / "none.jsonl").write_text('{"question": [{"role": "User", "content": "hi"}], "task": "x"}\n')
    result = invoke("eval", "run", "--model", "org/absent", "--data", tmp_path / "none.jsonl", "--out", tmp_path / "r")
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == EXIT_INPUT and len(errors) == 1 and errors[0].startswith("error: org/absent: not a local"), \
        result.output
    assert not (tmp_path / "r").exists() and not (tmp_path / "p").exists() and not (tmp_path / "a").exists()


def test_bake_from_a_hub_id_records_it(offline, tmp_path):
    from rolemrc.intervene.spec import Restraint

    spec = tmp_path / "r.yaml"
    Restraint(name="r", hook="mlp.act", units={1: [0, 3]}, factor=0.0).save(spec)
    result = invoke("intervene", "bake", "--model", "org/tiny@v2", "--restraint", spec, "--out", tmp_path / "baked")
    assert result.exit_code == 0, result.output
    provenance = json.loads((tmp_path / "baked" / "rolemrc.json").read_text())
    assert provenance["source_model"] == "org/tiny@v2" and provenance["source_dir"] == str(snapshot(offline, V2))
    assert provenance["source_fingerprint"] == dir_fingerprint(snapshot(offline, V2)) and provenance["dtype"] == "float32"


def test_eval_run_on_a_hub_id(offline, tmp_path):
    pytest.importorskip("rouge_score")
    data = tmp_path / "test.jsonl"
    write_jsonl(data, records_of(2))
    result = invoke("eval", "run", "--model", "org/tiny", "--data", data, "--out", tmp_path / "run",
                    "--max-new-tokens", "4", "--metrics", "rouge", "--rounds", "10")
    assert result.exit_code == 0, result.output
    assert len((tmp_path / "run" / "responses.jsonl").read_text().splitlines()) == 2


def test_a_server_serves_a_hub_id(hf_home, tmp_path):
    from rolemrc.serve.launch import start_server, stop_server

    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    server = start_server({"models": {"tiny": "org/tiny@v2"}, "db": None}, env=env, workdir=tmp_path)
    try:
        reply = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": "Hello", "max_tokens": 3}).json()
        assert reply["usage"]["completion_tokens"] == 3, reply
    finally:
        stop_server(server)


def test_a_server_config_naming_an_uncached_id_is_refused(offline, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("models:\n  tiny: org/absent\ndb: null\n")
    result = invoke("serve", "--config", config)
    assert result.exit_code == EXIT_INPUT, result.output
    assert "serve.yaml: model 'tiny': org/absent: not a local directory" in result.output, result.output


def test_python_verbs_take_hub_ids(offline, tmp_path):
    import rolemrc

    records = records_of(4)
    counts = rolemrc.collect("org/tiny", records)
    assert counts.meta["model"] == "org/tiny" and counts.meta["model_dir"] == str(snapshot(offline, MAIN))
    pairs = [{"id": r["id"], "prompt": r["question"], "chosen": "Aye.", "rejected": "No.", "task": r["task"]}
             for r in records]
    result = rolemrc.attribute(["org/tiny", "org/tiny@v2"], pairs)
    models = json.loads(result.meta["models"])
    assert models["dpo"]["model"] == "org/tiny@v2" and result.meta["batch_size"] == "4"
    assert os.fspath(snapshot(offline, V2)) == models["dpo"]["model_dir"]


@pytest.mark.slow
def test_smollm2_as_a_pulled_name_and_as_a_cached_hub_id(smollm2_dir, tmp_path, monkeypatch):
    """SmolLM2-135M-Instruct as `models pull` leaves it (the run's one pull, tests/test_models.py) in a temporary
    cache: by its pulled name, and laid into a temporary HF cache as HuggingFaceTB/SmolLM2-135M-Instruct, probed
    offline by hub id."""
    from rolemrc.models.known import default_dir

    monkeypatch.setenv("ROLEMRC_CACHE", str(tmp_path / "cache"))
    pulled = default_dir("smollm2-135m-instruct")
    shutil.copytree(smollm2_dir, pulled, copy_function=os.link)
    assert resolve_model("smollm2-135m-instruct") == pulled
    repo = "HuggingFaceTB/SmolLM2-135M-Instruct"
    cache_snapshot(tmp_path / "hf" / "hub", repo, pulled, "d" * 40)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_jsonl(tmp_path / "test.jsonl", records_of(3))
    result = invoke("probe", "collect", "--model", repo, "--data", tmp_path / "test.jsonl", "--out", tmp_path / "p.safetensors")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["layers"] == 30 and report["cases"]
    assert dir_fingerprint(repo) == dir_fingerprint(pulled)
