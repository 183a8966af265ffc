"""Regenerate the documentation's pictures and the notebooks' saved outputs from a demo run.

    python scripts/docs_pictures.py runs/demo                      # after `rolemrc demo --out runs/demo`
    python scripts/docs_pictures.py runs/demo --calibration runs/calibration

Writes into `--img` (docs/img): the diff's heatmaps (layers x dimensions, and the units of the dimension that shifted
most), a screenshot of the layer explorer (headless Chromium, that dimension's peak layer clicked), the sweep's
dose-response figure, the A/B chart, and, given a calibration run's folder, its chart. Executes
notebooks/layer_explorer.ipynb, notebooks/ab_testing.ipynb and notebooks/attribution.ipynb on the demo's outputs and
writes them, outputs saved, into `--notebooks` (notebooks/): each Plotly figure is saved as a static PNG (what GitHub
and any viewer show), with its interactive JSON beside it when that is small, and no output names a path of this
machine (the demo folder reads `runs/demo`, `rolemrc demo`'s default). The A/B chart is the ab_testing notebook's
figure.
Every PNG is stored with a 256-colour palette to stay small. Needs Chromium, kaleido, playwright and nbclient
(`make install`, scripts/system-deps.sh).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from PIL import Image, ImageOps

ROOT = Path(__file__).resolve().parents[1]
PLOTLY_JSON = "application/vnd.plotly.v1+json"
INTERACTIVE_MAX_BYTES = 64_000   # a figure's JSON kept in a notebook beside its PNG up to this size


def small_png(data: bytes) -> bytes:
    """The image with a 256-colour palette (Plotly charts and page screenshots stay sharp), optimised."""
    image = Image.open(io.BytesIO(data)).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def save_png(data: bytes, out: Path) -> Path:
    out.write_bytes(small_png(data))
    return out


def diff_heatmaps(demo: Path, img: Path, dimension: str) -> list[Path]:
    return [save_png((demo / "diff" / "heatmap_layers_dimensions.png").read_bytes(), img / "probe_heatmap_dimensions.png"),
            save_png((demo / "diff" / f"heatmap_units_{dimension}.png").read_bytes(), img / "probe_heatmap_units.png")]


def explorer_screenshot(demo: Path, img: Path, dimension: str, layer: int, *, selector: str | None = None,
                        name: str = "explorer.png") -> Path:
    """The explorer page with `dimension` (and `selector`, else the page's default) chosen, the bar of `layer` clicked
    (its unit panel shows) and the preview's first unit clicked (its top prompts under A and B show); machine paths
    read as in the notebooks (`stand_ins`)."""
    sys.path.insert(0, str(ROOT / "tests"))   # the tests' headless Chromium (Playwright on /usr/bin/chromium)
    from browser import browser_page

    with browser_page() as (page, errors):
        page.goto((demo / "explorer.html").as_uri())
        page.wait_for_function("window.explorerReady === true", timeout=30_000)
        page.select_option("#dimension", dimension)
        if selector:
            page.select_option("#selector", selector)
        box = page.locator("#layers .bars .point path").nth(layer).bounding_box()
        page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] - 3)
        page.wait_for_function(f"document.querySelector('#scatter .gtitle').textContent.startsWith('layer {layer}')")
        page.locator("#preview-table tr[data-unit]").first.click()
        page.wait_for_function("document.getElementById('prompts-sides').children.length > 0")
        page.evaluate("""(pairs) => {   // the models' paths on this machine read as stand_ins says
            const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
            for (let node = walk.nextNode(); node; node = walk.nextNode())
                for (const [path, name] of pairs) node.nodeValue = node.nodeValue.split(path).join(name);
        }""", list(stand_ins(demo.resolve()).items()))
        page.mouse.move(0, 0)   # no hover label or toolbar in the picture
        page.wait_for_timeout(500)
        shot = Image.open(io.BytesIO(page.screenshot(full_page=True)))
        if errors:
            raise RuntimeError(f"the explorer page logged errors: {errors}")
    content = ImageOps.invert(shot.convert("RGB")).getbbox()   # the page without its blank bottom
    buffer = io.BytesIO()
    shot.crop((0, 0, shot.width, min(shot.height, content[3] + 24))).save(buffer, format="PNG")
    return save_png(buffer.getvalue(), img / name)


def sweep_figure(demo: Path, img: Path, dimension: str) -> Path:
    return save_png((demo / "sweep" / f"dose_{dimension}.png").read_bytes(), img / "sweep_dose_response.png")


def static_figures(nb: nbformat.NotebookNode) -> list[bytes]:
    """Replace each Plotly output by its PNG (rendered by kaleido) and, when small, its JSON; drop the HTML (it loads
    plotly.js). Returns the PNGs in order."""
    import plotly.io as pio

    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if PLOTLY_JSON in o.get("data", {})]
    figures = [pio.from_json(json.dumps(o["data"][PLOTLY_JSON])) for o in outputs]
    pngs = [fig.to_image(format="png") for fig in figures]   # at the layout's size, where it sets one
    for output, fig, png in zip(outputs, figures, pngs):
        plotly_json = output["data"][PLOTLY_JSON]
        title = (fig.layout.title.text or "Plotly figure")
        output["data"] = {"image/png": base64.b64encode(small_png(png)).decode(), "text/plain": f"<{title}>"}
        if len(json.dumps(plotly_json)) <= INTERACTIVE_MAX_BYTES:
            output["data"][PLOTLY_JSON] = plotly_json
    return pngs


def stand_ins(demo: Path) -> dict[str, str]:
    """The machine paths a notebook's outputs may show, longest first, each with what it reads instead: the demo
    folder `runs/demo`, this checkout `.`, the home folder `~`, the temporary folder `$TMPDIR`."""
    paths = {str(demo): "runs/demo", str(ROOT): ".", str(Path.home()): "~", tempfile.gettempdir(): "$TMPDIR"}
    return dict(sorted(paths.items(), key=lambda item: -len(item[0])))


def replace_paths(nb: nbformat.NotebookNode, paths: dict[str, str]) -> None:
    """Replace each of `paths` by its stand-in in every output's text (streams, and data other than images)."""
    def replaced(text: str) -> str:
        for path, stand_in in paths.items():
            text = text.replace(path, stand_in)
        return text

    for output in (o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs):
        if "text" in output:
            output["text"] = replaced(output["text"])
        data = output.get("data", {})
        for mime in [m for m, value in data.items() if isinstance(value, str) and not m.startswith("image/")]:
            data[mime] = replaced(data[mime])


def execute(name: str, env: dict[str, str], out_dir: Path, paths: dict[str, str]) -> list[bytes]:
    """Execute notebooks/<name> with `env` set, save it with static figures and `paths` replaced (`replace_paths`)
    into out_dir; returns its figures' PNGs."""
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with tempfile.TemporaryDirectory() as cwd:
            NotebookClient(nb, timeout=900, kernel_name="python3", record_timing=False,
                           resources={"metadata": {"path": cwd}}).execute()
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.update({k: v})
    pngs = static_figures(nb)
    replace_paths(nb, paths)
    out_dir.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out_dir / name)
    return pngs


def notebooks(demo: Path, out_dir: Path, img: Path, ab_requests: int) -> list[Path]:
    """The notebooks executed on the demo's outputs (`ab_requests` A/B requests); the A/B notebook's chart becomes
    the A/B picture."""
    paths = stand_ins(demo)
    execute("layer_explorer.ipynb", {"ROLEMRC_DIFF_DIR": str(demo / "diff")}, out_dir, paths)
    ab = execute("ab_testing.ipynb", {"ROLEMRC_MODEL_DIR": str(demo / "dpo"), "ROLEMRC_RESTRAINT": str(demo / "restraint.yaml"),
                                      "ROLEMRC_TEST_DATA": str(demo / "data" / "test.jsonl"),
                                      "ROLEMRC_AB_REQUESTS": str(ab_requests)}, out_dir, paths)
    execute("attribution.ipynb", {"ROLEMRC_SFT_DIR": str(demo / "sft"), "ROLEMRC_DPO_DIR": str(demo / "dpo"),
                                  "ROLEMRC_PAIRS": str(demo / "data" / "pairs.jsonl"),
                                  "ROLEMRC_TEST_DATA": str(demo / "data" / "test.jsonl"),
                                  "ROLEMRC_DIFF_DIR": str(demo / "diff")}, out_dir, paths)
    return [out_dir / name for name in ("layer_explorer.ipynb", "ab_testing.ipynb", "attribution.ipynb")] + [
        save_png(ab[-1], img / "ab_chart.png")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("demo", type=Path, help="a `rolemrc demo --out` folder")
    parser.add_argument("--img", type=Path, default=ROOT / "docs" / "img", help="where the pictures go")
    parser.add_argument("--notebooks", type=Path, default=ROOT / "notebooks", help="where the executed notebooks go")
    parser.add_argument("--ab-requests", type=int, default=40, help="requests the A/B notebook sends (one user each)")
    parser.add_argument("--calibration", type=Path, help="a `rolemrc organism calibrate --out` folder (its chart)")
    args = parser.parse_args(argv)
    demo = args.demo.resolve()
    summary = json.loads((demo / "summary.json").read_text())
    shift = summary["largest_shift"]
    args.img.mkdir(parents=True, exist_ok=True)
    written = [*diff_heatmaps(demo, args.img, shift["dimension"]),
               explorer_screenshot(demo, args.img, shift["dimension"], shift["peak_layer"]),
               sweep_figure(demo, args.img, shift["dimension"]),
               *notebooks(demo, args.notebooks.resolve(), args.img, args.ab_requests)]
    if args.calibration:
        written.append(save_png((args.calibration / "calibration.png").read_bytes(), args.img / "calibration.png"))
    for path in written:
        print(f"{path.stat().st_size / 1000:7.1f} kB  {path}")


if __name__ == "__main__":
    main()
