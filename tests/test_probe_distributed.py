"""Probe collection across processes: `torchrun --nproc_per_node 2` and `accelerate launch --num_processes 2` (gloo
on the CPU) write the same probe file as one process, single and paired; sharding; `--device-map auto`; attribution
(`probe attribute`) under torchrun too."""

import json
import os
import subprocess
import sys

import pytest
from test_probe_attribution import changed, tiny
from test_probe_merge import assert_same_file
from train_fixtures import pair_records
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.io import write_jsonl
from rolemrc.core.taxonomy import TASKS
from rolemrc.probe import collect, collect_to_file
from rolemrc.probe.cases import batch_indices, build_cases

# Every torchrun check shares one launch (2 ranks, ~16 CPU-s each time): each rank collects single then paired
# through the API, then runs `probe collect` and `probe attribute` through the CLI (rolemrc.cli's app, as
# `python -m rolemrc.cli` runs it), all in its one process (the later collections reuse the process group). Only
# rank 0's two CLI reports may reach stdout: the API calls are quiet.
RANK_SCRIPT = """
import json, sys
from rolemrc.cli import app
from rolemrc.probe import collect_to_file
llama, qwen, data, out, commands = sys.argv[1:]
collect_to_file(llama, data, out + "/single.safetensors", tokens="last", batch_size=4, device="cpu", progress=False)
collect_to_file([llama, qwen], data, out + "/paired.safetensors", tokens="last", batch_size=4, device="cpu", progress=False)
for args in json.loads(commands):
    try:
        app(args)
    except SystemExit as exc:
        if exc.code:
            raise
"""


def launch(launcher, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "CUDA_VISIBLE_DEVICES": ""}  # gloo on the CPU
    res = subprocess.run([sys.executable, "-m", *launcher, *map(str, args)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def torchrun(*args):
    return launch(["torch.distributed.run", "--standalone", "--nproc_per_node", "2"], *args)


def accelerate_launch(*args):
    # --multi_gpu is accelerate's torchrun launcher; with no GPU visible the ranks run on the CPU (gloo)
    return launch(["accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                   "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"], *args)


def json_documents(text):
    """The JSON documents `text` holds one after another (anything else in it raises)."""
    decoder, docs, at = json.JSONDecoder(), [], 0
    while text[at:].strip():
        at += len(text[at:]) - len(text[at:].lstrip())
        doc, at = decoder.raw_decode(text, at)
        docs.append(doc)
    return docs


@pytest.fixture(scope="module")
def data(records, tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "test.jsonl"
    write_jsonl(path, records[:30])
    return path


@pytest.fixture(scope="module")
def attribution_inputs(tokenizer, tmp_path_factory):
    """test_probe_attribution's SFT Llama (3 layers), its DPO model (known units scaled by 1.5), saved, and its
    preference pairs over every task."""
    root = tmp_path_factory.mktemp("attribution")
    sft = tiny("llama", tokenizer)
    dirs = {}
    for name, model in (("sft", sft), ("dpo", changed(sft, 1.5))):
        dirs[name] = root / name
        model.save_pretrained(dirs[name])
        tokenizer.save_pretrained(dirs[name])
    write_jsonl(root / "pairs.jsonl", [{**p, "task": TASKS[i % len(TASKS)]} for i, p in enumerate(pair_records(20))])
    return dirs, root / "pairs.jsonl"


COLLECT = ["probe", "collect", "--tokens", "all", "--batch-size", "4"]   # + the models and data
ATTRIBUTE = ["probe", "attribute", "--batch-size", "2"]   # + the models and pairs


@pytest.fixture(scope="module")
def torchrun_run(model_dirs, data, attribution_inputs, tmp_path_factory):
    """The one torchrun launch: its folder (single.safetensors, paired.safetensors, cli.safetensors,
    attribution.safetensors) and the JSON documents on its stdout."""
    out = tmp_path_factory.mktemp("torchrun")
    (dirs, pairs), llama, qwen = attribution_inputs, model_dirs["llama"], model_dirs["qwen2"]
    commands = [[*COLLECT, "--model", str(llama), "--model", str(qwen), "--data", str(data), "--device-map", "auto",
                 "--out", str(out / "cli.safetensors")],
                [*ATTRIBUTE, "--model", str(dirs["sft"]), "--model", str(dirs["dpo"]), "--pairs", str(pairs),
                 "--out", str(out / "attribution.safetensors")]]
    (out / "rank.py").write_text(RANK_SCRIPT)
    stdout = torchrun(out / "rank.py", llama, qwen, data, out, json.dumps(commands))
    return out, json_documents(stdout)


def test_two_processes_write_what_one_process_writes(torchrun_run, model_dirs, data, tmp_path):
    llama, qwen = model_dirs["llama"], model_dirs["qwen2"]
    two, reports = torchrun_run
    assert len(reports) == 2  # quiet: nothing on stdout but rank 0's reports of the two CLI commands
    for name, models in (("single", llama), ("paired", [llama, qwen])):
        one = collect_to_file(models, data, tmp_path / f"{name}.safetensors", tokens="last", batch_size=4, device="cpu",
                              progress=False)
        assert_same_file(two / f"{name}.safetensors", one, ignore=())


def test_torchrun_cli_paired_tokens_all_with_device_map(torchrun_run, model_dirs, data, tmp_path):
    two, (report, _) = torchrun_run  # rank 0's report alone
    assert report["out"] == str(two / "cli.safetensors") and sum(report["cases"].values()) >= 30
    args = [*COLLECT, "--model", str(model_dirs["llama"]), "--model", str(model_dirs["qwen2"]), "--data", str(data)]
    res = CliRunner().invoke(app, [*args, "--device", "cpu", "--out", str(tmp_path / "one.safetensors")])
    assert res.exit_code == 0, res.output
    assert_same_file(two / "cli.safetensors", tmp_path / "one.safetensors", ignore=())


def test_torchrun_attribute_writes_what_one_process_writes(torchrun_run, attribution_inputs, tmp_path):
    """`probe attribute`'s shards under torchrun merged equal one pass bit for bit (tests/test_probe_attribution.py
    merges shards of files)."""
    two, (_, report) = torchrun_run
    (dirs, pairs) = attribution_inputs
    assert report["out"] == str(two / "attribution.safetensors")
    args = [*ATTRIBUTE, "--model", str(dirs["sft"]), "--model", str(dirs["dpo"]), "--pairs", str(pairs)]
    res = CliRunner().invoke(app, [*args, "--device", "cpu", "--out", str(tmp_path / "one.safetensors")])
    assert res.exit_code == 0, res.output
    assert_same_file(two / "attribution.safetensors", tmp_path / "one.safetensors", ignore=())


def test_accelerate_launch_cli_writes_what_one_process_writes(model_dirs, data, tmp_path):
    args = ["probe", "collect", "--model", model_dirs["llama"], "--data", data, "--batch-size", 4]
    report = json.loads(accelerate_launch("-m", "rolemrc.cli", *args, "--out", tmp_path / "two.safetensors"))
    assert report["out"] == str(tmp_path / "two.safetensors")
    res = CliRunner().invoke(app, [*map(str, args), "--device", "cpu", "--out", str(tmp_path / "one.safetensors")])
    assert res.exit_code == 0, res.output
    assert_same_file(tmp_path / "two.safetensors", tmp_path / "one.safetensors", ignore=())


def test_shards_are_every_nth_batch(tokenizer, records):
    cases = build_cases(records, tokenizer)
    alone = batch_indices(cases, 4)
    shards = [batch_indices(cases, 4, rank, 3) for rank in range(3)]
    assert sorted(b for shard in shards for b in shard) == sorted(alone)
    assert shards[1] == alone[1::3] and sum(map(len, shards[0])) >= sum(map(len, shards[2]))


def test_device_map_auto_gives_identical_counts(model_dirs, records):
    kw = {"batch_size": 8, "progress": False}
    placed = collect(model_dirs["gpt2"], records, device_map="auto", **kw)
    plain = collect(model_dirs["gpt2"], records, device="cpu", **kw)
    assert placed.meta == plain.meta
    for d in plain.dimensions:
        assert (placed.count[d] == plain.count[d]).all()
    with pytest.raises(ValueError, match="not both"):
        collect(model_dirs["gpt2"], records, device="cpu", device_map="auto", **kw)
    with pytest.raises(ValueError, match="unknown device map 'everywhere'"):
        collect(model_dirs["gpt2"], records, device_map="everywhere", **kw)
