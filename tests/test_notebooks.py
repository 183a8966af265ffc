"""The notebooks run top to bottom on small fixtures (nbclient), so they cannot rot; the committed ones carry the
outputs of a demo run (scripts/docs_pictures.py), each figure as a PNG."""

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from rolemrc.core.tiny import build_model
from rolemrc.probe import collect_paired, diff, write_diff

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PLOTLY_JSON = "application/vnd.plotly.v1+json"


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


def test_layer_explorer_notebook(model_dirs, records, tokenizer, tmp_path):
    other = tmp_path / "b"
    build_model("llama", tokenizer, seed=5, hidden=64, layers=2, intermediate=96).save_pretrained(other)
    tokenizer.save_pretrained(other)
    result = diff(collect_paired([model_dirs["llama"], other], records, device="cpu", progress=False))
    write_diff(result, tmp_path / "diff", figures=False)
    nb = run_notebook("layer_explorer.ipynb", {"ROLEMRC_DIFF_DIR": str(tmp_path / "diff")}, tmp_path)
    text = outputs_text(nb)
    assert "hook mlp.act: 2 layers x 96 units" in text and "largest shift:" in text
    assert "per-unit test: mcnemar" in text   # the paired diff docs/probe.md recommends
    plots = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs
             if PLOTLY_JSON in o.get("data", {})]
    assert len(plots) >= 4


def test_ab_testing_notebook(model_dirs, records, tmp_path):
    from rolemrc.core.io import write_jsonl
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
    for name, figures in (("layer_explorer.ipynb", 4), ("ab_testing.ipynb", 1)):
        path = NOTEBOOKS / name
        assert unsaved_outputs(path) == [], name
        nb = nbformat.read(path, as_version=4)
        pngs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if "image/png" in o.get("data", {})]
        assert len(pngs) == figures and path.stat().st_size < 1_000_000, name
