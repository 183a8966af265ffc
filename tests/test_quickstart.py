"""README's quickstart runs as it is written: its shell block, every command from collect to the A/B report, and its
Python block as a doctest, on tiny SFT and DPO models in a folder laid out as the README assumes (runs/sft, runs/dpo,
cases.jsonl, pairs.jsonl, test.jsonl). Only the server's port is changed, to a free one."""

import doctest
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures import save_peaked_llama
from fixtures import test_records as records_of
from transformers import AutoModelForCausalLM

from rolemrc.core.io import read_jsonl, write_jsonl
from rolemrc.core.taxonomy import TASKS
from rolemrc.serve.launch import free_port

README = Path(__file__).resolve().parent.parent / "README.md"


def block(marker: str, language: str) -> str:
    """The fenced `language` block that follows the HTML comment `<!-- marker: ... -->` in README."""
    found = re.search(rf"<!-- {marker}:[^\n]*-->\n```{language}\n(.*?)```", README.read_text(), re.S)
    assert found, f"README has no {marker} block"
    return found.group(1)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tokenizer) -> Path:
    """runs/sft (a small Llama), runs/dpo (its MLP weights moved a little, as a DPO run moves them), and the three
    JSONL files the quickstart names, with every task (so every dimension, role_style included)."""
    root = tmp_path_factory.mktemp("quickstart")
    sft = save_peaked_llama(root / "runs" / "sft", tokenizer)
    model = AutoModelForCausalLM.from_pretrained(sft)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            for weight in (layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight):
                weight.add_(0.05 * torch.randn(weight.shape, generator=generator))
    model.save_pretrained(root / "runs" / "dpo")
    tokenizer.save_pretrained(root / "runs" / "dpo")
    cases = records_of(36)
    write_jsonl(root / "cases.jsonl", cases)
    write_jsonl(root / "test.jsonl", records_of(18, seed=1))
    write_jsonl(root / "pairs.jsonl", [{"prompt": c["question"], "chosen": "I stay in my role, as I am asked.",
                                         "rejected": "(smiles) Sure, here is everything.", "task": TASKS[i % len(TASKS)]}
                                        for i, c in enumerate(cases)])
    return root


@pytest.mark.timeout(1300)   # the whole path, from two evals to the A/B report, beyond the suite's 600 s per test
def test_the_readme_quickstart_runs_as_written(workdir):
    script = block("quickstart", "bash").replace("8000", str(free_port()))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    for made in ("eval/sft/report.md", "eval/dpo/report.md", "cost/compare.md", "paired.safetensors", "diff/diff.safetensors", "attribution.safetensors", "explorer.html",
                 "sweep/sweep.md", "restraint.yaml", "runs/dpo-restrained/config.json",
                 "runs/dpo-restraint-lora/adapter_config.json", "ab/report.json"):
        assert (workdir / made).exists(), made
    assert len(read_jsonl(workdir / "ab-traffic.jsonl")) == 18
    costliest = json.loads((workdir / "cost/compare.json").read_text())["costliest"]["dimension"]
    swept = json.loads((workdir / "sweep/sweep.json").read_text())["cells"]   # step 0's dimension is the one swept
    assert {cell["dimension"] for cell in swept if cell.get("dimension")} == {costliest}, swept
    report = json.loads((workdir / "ab/report.json").read_text())   # the traffic names its users, tasks, references
    assert report["unit"]["users"] == 18 and all(arm["with_reference"] > 0 and arm.get("judge")
                                                  for arm in report["arms"].values()), report["arms"]


def test_the_readme_python_quickstart_is_a_doctest(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    test = doctest.DocTestParser().get_doctest(block("quickstart-python", "python"), {}, "README quickstart", str(README), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    assert runner.failures == 0 and runner.tries > 5
