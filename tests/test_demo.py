"""`rolemrc demo` end to end at a micro scale: every artifact exists, a rerun reuses every stage, and a
changed setting reruns only the stages downstream of it; scripts/docs_pictures.py makes the docs' pictures and the
notebooks' outputs from a run. The pretrained path (`--base DIR`) runs on a small
Llama whose chat template, like SmolLM2's, has no {% generation %} markers, with LoRA SFT/DPO, an ablation,
the LoRA export and (where vLLM is installed, as under `make test`) the vLLM engine."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from fixtures import SMOLLM2_TEMPLATE, save_peaked_llama
from test_notebooks import machine_paths, outputs_text, unsaved_outputs
from typer.testing import CliRunner

from rolemrc.cli import app

MICRO_PROFILE = """
base: {vocab_size: 400, hidden: 64, layers: 2, intermediate: 128, heads: 1, max_positions: 1024, block_size: 128,
       batch_size: 8, trl: {learning_rate: 3.0e-3, max_steps: 4, logging_steps: 1, save_steps: 100}}
sft: {batch_size: 4, trl: {learning_rate: 5.0e-4, max_steps: 3, max_length: 1024, logging_steps: 1, save_steps: 100}}
dpo: {batch_size: 2, trl: {learning_rate: 5.0e-5, max_steps: 2, max_length: 1024, logging_steps: 1, save_steps: 100}}
"""
UPSTREAM = ("datagen", "train base", "train sft", "train dpo", "eval sft", "eval dpo",
            "probe sft+dpo", "probe diff", "explorer", "restraint sweep")   # the restraint's factor changes none
DOWNSTREAM = ("restraint select", "restraint bake", "restraint check", "eval dpo-restrained",
              "eval compare dpo-restrained", "serve")
LORA_PROFILE = """
sft: {lora: true, lora_r: 4, lora_alpha: 8, batch_size: 4,
      trl: {learning_rate: 1.0e-2, max_steps: 2, max_length: 4096, logging_steps: 1, save_steps: 100}}
dpo: {lora: true, lora_r: 4, lora_alpha: 8, batch_size: 2,
      trl: {learning_rate: 1.0e-2, max_steps: 2, max_length: 4096, logging_steps: 1, save_steps: 100}}
"""


pytestmark = pytest.mark.usefixtures("png_export")   # the run's PNGs, the docs' pictures, the notebooks' figures

# notebook -> (its figures, what it prints on a demo run)
NOTEBOOK_OUTPUTS = {
    "layer_explorer.ipynb": (4, ("hook mlp.act: 2 layers x 128 units", "largest shift:", "per-unit test: mcnemar")),
    "ab_testing.ipynb": (1, ("'dpo', 'dpo+", "restrained vs control", "server exited with 0")),
    "attribution.ipynb": (2, ("preference pairs,", "hook mlp.act: 2 layers x 128 units", "restrained below:",
                              "'numerical_noop': False", "DPO restrained", "cells differ from the baseline")),
}


def demo(out: Path, profile: Path, *extra: str) -> dict:
    result = CliRunner().invoke(app, ["demo", "--out", str(out), "--size", "tiny", "--profile", str(profile),
                                      "--max-new-tokens", "8", "--top-k", "16", *extra])
    assert result.exit_code == 0, result.output
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    profile = root / "micro.yaml"
    profile.write_text(MICRO_PROFILE)
    return root / "out", profile, demo(root / "out", profile, "--no-vllm", "--sweep-items", "12")


def test_demo_writes_every_artifact_and_an_honest_summary(first_run):
    out, _, summary = first_run
    for name, path in summary["artifacts"].items():
        assert Path(path).exists(), f"{name}: {path} missing"
    assert (out / "explorer.html").is_file() and list((out / "diff").glob("*.png"))
    assert summary["largest_shift"]["dimension"] in summary["restraint_effect"]["verdicts"]
    assert summary["restraint"]["factor"] == pytest.approx(1 - 1e-6)
    assert summary["conclusion"].startswith(f"The restraint ({summary['restraint']['units']} units x 0.999999) changed")
    for run in ("sft", "dpo", "dpo-restrained"):
        ci = summary["eval"][run]["judge_avg_weighted"]
        assert ci["lo"] <= ci["mean"] <= ci["hi"]
    served = summary["serve"]
    assert served["hook_equals_baked"] is True and len(served["replies"]) == 4 and served["vllm"] == "skipped: --no-vllm"
    assert set(summary["stage_seconds"]) == set(summary["stages_run"]) == {*UPSTREAM, *DOWNSTREAM}
    assert json.loads((out / "stages.json").read_text()).keys() == summary["stage_seconds"].keys()


def test_demo_sweeps_factors_and_unit_counts_against_controls(first_run):
    out, _, summary = first_run
    sweep = summary["sweep"]
    assert [(c["budget"], c["factor"]) for c in sweep["cells"]] == [({"top_k": k}, f) for k in (16, 64)
                                                                      for f in (1 - 1e-6, 0.5, 0.0)]
    assert all(c["coverage"]["units"] == c["units"] and "per_layer" in c["coverage"] for c in sweep["cells"])
    plan = json.loads((out / "sweep" / "plan.json").read_text())["cells"]
    assert len(plan) == 1 + 6 * 3 and len(list((out / "sweep" / "cells").glob("*.jsonl"))) == len(plan)
    assert sweep["cells"][0]["max_logit_shift"] < 1e-4 < sweep["cells"][2]["max_logit_shift"]   # x(1-1e-6) vs x0
    results = (out / "results.md").read_text()
    dimension = summary["largest_shift"]["dimension"]
    assert "## Restraint sweep" in results and sweep["headline"] in results and f"| {dimension} top-64 x0 | {sweep['cells'][5]['units']} |" in results
    assert (out / "sweep" / "effects_vs_controls.png").stat().st_size > 5000


def test_rerun_reuses_every_stage_and_a_new_factor_reruns_only_downstream(first_run):
    out, profile, _ = first_run
    again = demo(out, profile, "--no-vllm", "--sweep-items", "12")
    assert again["stages_run"] == [] and set(again["stage_seconds"].values()) == {0.0}
    ablated = demo(out, profile, "--no-vllm", "--sweep-items", "12", "--factor", "0")
    assert set(ablated["stages_run"]) == set(DOWNSTREAM)   # select, bake, check, eval after, compare, serve
    assert ablated["restraint"]["factor"] == 0


def test_docs_pictures_come_from_a_demo_run(first_run, tmp_path):
    out, _, _ = first_run
    root = Path(__file__).resolve().parents[1]
    page = tmp_path / "demo.md"   # a copy of docs/demo.md: its demo-run block is rewritten from this run
    page.write_text((root / "docs" / "demo.md").read_text())
    proc = subprocess.run([sys.executable, str(root / "scripts" / "docs_pictures.py"), str(out), "--img", str(tmp_path / "img"),
                           "--notebooks", str(tmp_path / "notebooks"), "--demo-page", str(page),
                           "--ab-requests", "8"],   # the micro model's 1,024-token window holds the first 13 prompts
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    block = " ".join(page.read_text().split("<!-- demo-run:")[1].split("<!-- /demo-run -->")[0].split())
    assert " ".join(summary["conclusion"].split()) in block and f"`{summary['largest_shift']['dimension']}`" in block
    assert str(page) in proc.stdout
    pictures = {p.name: p.stat().st_size for p in (tmp_path / "img").iterdir()}
    assert set(pictures) == {"probe_heatmap_dimensions.png", "probe_heatmap_units.png", "explorer.png",
                             "sweep_dose_response.png", "ab_chart.png"}
    assert all(2_000 < size < 400_000 for size in pictures.values()), pictures
    for name, (figures, says) in NOTEBOOK_OUTPUTS.items():   # each ran top to bottom on the run
        path = tmp_path / "notebooks" / name
        assert unsaved_outputs(path) == machine_paths(path) == [], name
        nb = nbformat.read(path, as_version=4)
        text = outputs_text(nb)
        assert [s for s in says if s not in text] == [], (name, text[-3000:])
        assert sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs) == figures


@pytest.fixture(scope="module")
def pretrained_run(tmp_path_factory, tokenizer, first_run):
    """The demo from a 'pretrained' directory: a Llama (head dim 32, as vLLM's CPU attention needs) with a scaled-up
    output head, so greedy text has clear margins, and SmolLM2's marker-less chat template. Its datagen stage (the
    same --size and seed as first_run's, so the same data) is reused from first_run's, as a rerun reuses a stage."""
    root = tmp_path_factory.mktemp("demo-pretrained")
    base, profile = root / "instruct", root / "lora.yaml"
    done, _, _ = first_run
    shutil.copytree(done / "data", root / "out" / "data")
    stages = json.loads((done / "stages.json").read_text())
    (root / "out" / "stages.json").write_text(json.dumps({"datagen": stages["datagen"]}))
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = SMOLLM2_TEMPLATE
    save_peaked_llama(base, tok, seed=5, max_positions=4096)
    profile.write_text(LORA_PROFILE)
    return root / "out", demo(root / "out", profile, "--base", str(base), "--no-sweep")   # the sweep: first_run


def test_pretrained_base_runs_the_whole_method_with_lora_ablation_and_results(pretrained_run):
    out, summary = pretrained_run
    assert "train base" not in summary["stages_run"] and "datagen" not in summary["stages_run"]
    assert list(summary["eval"]) == ["instruct", "sft", "dpo", "dpo-restrained", "dpo-ablated"]
    for name, path in summary["artifacts"].items():
        assert Path(path).exists(), f"{name}: {path} missing"
    assert json.loads((out / "dpo" / "rolemrc.json").read_text())["config"]["lora"] is True
    assert (Path(summary["artifacts"]["restraint_lora"]) / "adapter_model.safetensors").is_file()
    effects = summary["restraint_effects"]
    assert effects["ablation"]["factor"] == 0 and 0 < effects["restraint"]["units"] == effects["ablation"]["units"] <= 16
    results = (out / "results.md").read_text()
    for model in summary["eval"]:
        assert f"| {model} |" in results
    assert results.count("[") >= 5 * 6 and effects["ablation"]["conclusion"] in results


def test_pretrained_demo_serves_the_restraint_on_every_installed_engine(pretrained_run):
    _, summary = pretrained_run
    served = summary["serve"]
    assert served["hook_equals_baked"] is True
    if served["vllm"].startswith("skipped"):
        assert os.environ.get("ROLEMRC_REQUIRE_VLLM") != "1", served["vllm"]
        return
    restraint = next(m for m in served["models"] if m.startswith("dpo-vllm+"))
    agreement = served["agreement"]
    assert agreement[f"{restraint} == {restraint.replace('dpo-vllm', 'dpo')}"] == "4/4"   # LoRA adapter == hook
    assert agreement["dpo-vllm == dpo"] == "4/4"
