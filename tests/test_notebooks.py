"""The committed notebooks carry the outputs of a demo run (scripts/docs_pictures.py), each figure as a PNG, and no
machine path. They run top to bottom (nbclient) in test_demo.py, where that script makes their outputs from a fresh
demo run and what each prints is checked, so they cannot rot."""

import re
from pathlib import Path

import nbformat

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PLOTLY_JSON = "application/vnd.plotly.v1+json"
# an absolute path on some machine: /work/..., /tmp/..., /home/..., C:\Users\... (not a URL's path or a relative one)
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|tmp|root|home|Users|private|var|mnt|opt|srv|data)/|\b[A-Z]:\\")


def outputs_text(nb: nbformat.NotebookNode) -> str:
    """What a notebook's code cells printed and displayed as text."""
    return "\n".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", ""))
                     for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs)


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
