"""Probe collection across processes: `torchrun --nproc_per_node 2` and `accelerate launch --num_processes 2` (gloo
on the CPU) write the same probe file as one process, single and paired; sharding; `--device-map auto`."""

import json
import os
import subprocess
import sys

import pytest
from test_probe_merge import assert_same_file
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.io import write_jsonl
from rolemrc.probe import collect, collect_to_file
from rolemrc.probe.cases import batch_indices, build_cases

# Each rank collects single then paired in one process (the second collection reuses the process group).
API_SCRIPT = """
import sys
from rolemrc.probe import collect_to_file
llama, qwen, data, out = sys.argv[1:]
collect_to_file(llama, data, out + "/single.safetensors", tokens="last", batch_size=4, device="cpu", progress=False)
collect_to_file([llama, qwen], data, out + "/paired.safetensors", tokens="last", batch_size=4, device="cpu", progress=False)
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


@pytest.fixture(scope="module")
def data(records, tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "test.jsonl"
    write_jsonl(path, records[:30])
    return path


def test_two_processes_write_what_one_process_writes(model_dirs, data, tmp_path):
    llama, qwen = model_dirs["llama"], model_dirs["qwen2"]
    (tmp_path / "two").mkdir()
    script = tmp_path / "collect.py"
    script.write_text(API_SCRIPT)
    assert torchrun(script, llama, qwen, data, tmp_path / "two") == ""  # quiet: nothing on stdout
    for name, models in (("single", llama), ("paired", [llama, qwen])):
        one = collect_to_file(models, data, tmp_path / f"{name}.safetensors", tokens="last", batch_size=4, device="cpu",
                              progress=False)
        assert_same_file(tmp_path / "two" / f"{name}.safetensors", one, ignore=())


def test_torchrun_cli_paired_tokens_all_with_device_map(model_dirs, data, tmp_path):
    args = ["probe", "collect", "--model", model_dirs["llama"], "--model", model_dirs["qwen2"], "--data", data,
            "--tokens", "all", "--batch-size", 4]
    out = torchrun("-m", "rolemrc.cli", *args, "--device-map", "auto", "--out", tmp_path / "two.safetensors")
    report = json.loads(out)  # rank 0's report alone
    assert report["out"] == str(tmp_path / "two.safetensors") and sum(report["cases"].values()) >= 30
    res = CliRunner().invoke(app, [*map(str, args), "--device", "cpu", "--out", str(tmp_path / "one.safetensors")])
    assert res.exit_code == 0, res.output
    assert_same_file(tmp_path / "two.safetensors", tmp_path / "one.safetensors", ignore=())


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
