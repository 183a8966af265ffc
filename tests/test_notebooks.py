"""The notebooks run top to bottom on small fixtures (nbclient), so they cannot rot; the committed ones carry the
outputs of a demo run (scripts/docs_pictures.py), each figure as a PNG."""

import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from train_fixtures import pair_records

from rolemrc.core.io import write_jsonl
from rolemrc.core.taxonomy import TASKS
from rolemrc.core.tiny import build_model
from rolemrc.probe import collect_paired, diff, write_diff

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PLOTLY_JSON = "application/vnd.plotly.v1+json"
# an absolute path on some machine: /work/..., /tmp/..., /home/..., C:\Users\... (not a URL's path or a relative one)
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|tmp|root|home|Users|private|var|mnt|opt|srv|data)/|\b[A-Z]:\\")


def run_notebook(name: str, env: dict[str, str], tmp_path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def outputs_text(nb) -> str:
    return "\n".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", ""))
                     for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs)


@pytest.fixture(scope="module")
def pair(model_dirs, records, tokenizer, tmp_path_factory) -> dict[str, Path]:
    """A tiny SFT/DPO stand-in (two Llamas of one shape), their paired diff, preference pairs and test records."""
    root = tmp_path_factory.mktemp("pair")
    build_model("llama", tokenizer, seed=5, hidden=64, layers=2, intermediate=96).save_pretrained(root / "dpo")
    tokenizer.save_pretrained(root / "dpo")
    result = diff(collect_paired([model_dirs["llama"], root / "dpo"], records, device="cpu", progress=False))
    write_diff(result, root / "diff", figures=False)
    write_jsonl(root / "pairs.jsonl", [{**p, "task": TASKS[i % len(TASKS)]} for i, p in enumerate(pair_records(18))])
    write_jsonl(root / "test.jsonl", records)
    return {"sft": model_dirs["llama"], **{name: root / name for name in ("dpo", "diff")},
            "pairs": root / "pairs.jsonl", "test": root / "test.jsonl"}


def test_layer_explorer_notebook(pair, tmp_path):
    nb = run_notebook("layer_explorer.ipynb", {"ROLEMRC_DIFF_DIR": str(pair["diff"])}, tmp_path)
    text = outputs_text(nb)
    assert "hook mlp.act: 2 layers x 96 units" in text and "largest shift:" in text
    assert "per-unit test: mcnemar" in text   # the paired diff docs/probe.md recommends
    plots = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs
             if PLOTLY_JSON in o.get("data", {})]
    assert len(plots) >= 4


def test_ab_testing_notebook(model_dirs, records, tmp_path):
    from rolemrc.intervene import Restraint

    spec = Restraint(name="r", hook="mlp.act", units={0: [1, 2, 3], 1: [4, 5]}, factor=0.0).save(tmp_path / "r.yaml")
    write_jsonl(tmp_path / "test.jsonl", records)
    nb = run_notebook("ab_testing.ipynb", {"ROLEMRC_MODEL_DIR": str(model_dirs["llama"]), "ROLEMRC_RESTRAINT": str(spec),
                                           "ROLEMRC_TEST_DATA": str(tmp_path / "test.jsonl"),
                                           "ROLEMRC_AB_REQUESTS": "12"}, tmp_path)
    text = outputs_text(nb)
    assert "'dpo', 'dpo+r'" in text, text
    assert "control" in text and "restrained" in text
    assert "restrained vs control" in text and "server exited with 0" in text
    plots = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs
             if PLOTLY_JSON in o.get("data", {})]
    assert len(plots) == 1


def test_attribution_notebook(pair, tmp_path):
    nb = run_notebook("attribution.ipynb", {"ROLEMRC_SFT_DIR": str(pair["sft"]), "ROLEMRC_DPO_DIR": str(pair["dpo"]),
                                            "ROLEMRC_PAIRS": str(pair["pairs"]), "ROLEMRC_TEST_DATA": str(pair["test"]),
                                            "ROLEMRC_DIFF_DIR": str(pair["diff"]), "ROLEMRC_SWEEP_CASES": "6"}, tmp_path)
    text = outputs_text(nb)
    assert "18 preference pairs, 40 test records" in text and "hook mlp.act: 2 layers x 96 units" in text, text
    assert "restrained below:" in text and "'method': 'attribution'" not in text   # the summary's chosen keys only
    assert "'units': 4" in text and "'numerical_noop': False" in text   # 2% of 192 units, ablated
    assert "DPO restrained" in text and "cells differ from the baseline" in text
    plots = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs
             if PLOTLY_JSON in o.get("data", {})]
    assert len(plots) == 2 and "95% bootstrap CI" in str(plots[-1]["data"][PLOTLY_JSON]["layout"]["title"])


def machine_paths(path: Path) -> list[str]:
    """The absolute machine paths in a notebook's sources and outputs (its text; images are left out)."""
    nb = nbformat.read(path, as_version=4)
    texts = [cell.source for cell in nb.cells]
    for cell in (c for c in nb.cells if c.cell_type == "code"):
        for output in cell.outputs:
            texts += [str(output.get("text", "")), "\n".join(output.get("traceback", []))]
            texts += [str(v) for k, v in output.get("data", {}).items() if not k.startswith("image/")]
    return [text[max(m.start() - 40, 0):m.end() + 40] for text in texts for m in MACHINE_PATH.finditer(text)]


def test_no_notebook_shows_a_machine_path():
    assert MACHINE_PATH.search("model /work/demo/dpo") and MACHINE_PATH.search("file:///tmp/x") and MACHINE_PATH.search(
        "C:\\Users\\me")
    assert not MACHINE_PATH.search("runs/demo/dpo, ../runs/demo, https://x.io/tmp/y, http://127.0.0.1:80/v1")
    notebooks = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert len(notebooks) >= 3
    for path in notebooks:
        assert machine_paths(path) == [], path.name


def unsaved_outputs(path: Path) -> list[str]:
    """What keeps a notebook file from showing its run: a code cell never run or without output, an error, a
    figure without a static PNG, plotly.js embedded (HTML output)."""
    nb = nbformat.read(path, as_version=4)
    problems = []
    for k, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        data = [o.get("data", {}) for o in cell.outputs]
        if cell.execution_count is None or not cell.outputs:
            problems.append(f"code cell {k}: not run or no output")
        problems += [f"code cell {k}: {o.ename}" for o in cell.outputs if o.output_type == "error"]
        problems += [f"code cell {k}: a figure without image/png" for d in data if PLOTLY_JSON in d and "image/png" not in d]
        problems += [f"code cell {k}: HTML output" for d in data if "text/html" in d and "plotly" in d["text/html"]]
    return problems


def test_committed_notebooks_carry_their_outputs():
    figures_of = {"layer_explorer.ipynb": 4, "ab_testing.ipynb": 1, "attribution.ipynb": 2}
    assert sorted(figures_of) == sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))   # every notebook, outputs saved
    for name, figures in figures_of.items():
        path = NOTEBOOKS / name
        assert unsaved_outputs(path) == [], name
        nb = nbformat.read(path, as_version=4)
        pngs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if "image/png" in o.get("data", {})]
        assert len(pngs) == figures and path.stat().st_size < 1_000_000, name
