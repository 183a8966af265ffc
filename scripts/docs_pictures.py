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
Rewrites the block of `--demo-page` (docs/demo.md) between its demo-run markers from the run's files (summary.json,
stages.json, the SFT and DPO evals, the sweep's scores): the stage times, the restraint's verdict, the sweep's
headline and largest effects, SFT against DPO on the judge, and the dimension that shifted most with its peak layer,
so every figure the page gives for its run is that run's.
Every PNG is stored with a 256-colour palette to stay small. Needs Chromium, kaleido, playwright and nbclient
(`make install`, scripts/system-deps.sh).
"""

from __future__ import annotations

import argparse
import asyncio
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
    from browser import browser_page, chromium

    with chromium() as context, browser_page(context) as (page, errors):
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


async def render_pngs(figures: list, tries: int = 3) -> list[bytes]:
    """The figures' PNGs at each layout's size, in one Chromium and with no deadline per figure: kaleido's default
    (90 s, a Chromium per `to_image`) is overrun when the suite loads the machine's other core. On a loaded machine
    kaleido 1.5 may also take the blank page's JavaScript context for its own (`kaleido_scopes is not defined`): a new
    Chromium then renders the rest, up to `tries` times."""
    import kaleido
    from kaleido.errors import JavascriptError

    pngs: list[bytes] = []
    for attempt in range(1, tries + 1):
        try:
            async with kaleido.Kaleido(n=1, timeout=None) as session:
                for fig in figures[len(pngs):]:
                    pngs.append(await session.calc_fig(fig, opts={"format": "png"}))
            return pngs
        except JavascriptError as exc:
            if "kaleido_scopes is not defined" not in str(exc) or attempt == tries:
                raise
    return pngs


def static_figures(nb: nbformat.NotebookNode) -> list[bytes]:
    """Replace each Plotly output by its PNG (rendered by kaleido) and, when small, its JSON; drop the HTML (it loads
    plotly.js). Returns the PNGs in order."""
    import plotly.io as pio

    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if PLOTLY_JSON in o.get("data", {})]
    figures = [pio.from_json(json.dumps(o["data"][PLOTLY_JSON])) for o in outputs]
    pngs = asyncio.run(render_pngs(figures))
    for output, fig, png in zip(outputs, figures, pngs):
        plotly_json = output["data"][PLOTLY_JSON]
        title = (fig.layout.title.text or "Plotly figure")
        output["data"] = {"image/png": base64.b64encode(small_png(png)).decode(), "text/plain": f"<{title}>"}
        if len(json.dumps(plotly_json)) <= INTERACTIVE_MAX_BYTES:
            output["data"][PLOTLY_JSON] = plotly_json
    return pngs


def stand_ins(demo: Path) -> dict[str, str]:
    """The machine paths a notebook's outputs may show, longest first, each with what it reads instead: the demo
    folder `runs/demo`, this checkout `.`, the Python environment `.venv` (inside the checkout or not), the home folder
    `~`, the temporary folder `$TMPDIR`."""
    paths = {str(demo): "runs/demo", str(ROOT): ".", sys.prefix: ".venv", str(Path.home()): "~",
             tempfile.gettempdir(): "$TMPDIR"}
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


# docs/demo.md's block of figures from the demo's run, between these markers (`write_demo_page`)
DEMO_RUN_START = "<!-- demo-run: generated by scripts/docs_pictures.py from runs/demo; do not edit by hand -->"
DEMO_RUN_END = "<!-- /demo-run -->"
# the rows of docs/demo.md's stage table: (row, the demo's cached stages it covers, whether its time is per stage
# ("each") rather than their sum); a stage no row names gets a row of its own
STAGE_ROWS = (("datagen", ("datagen",), False), ("train base", ("train base",), False),
              ("train sft", ("train sft",), False), ("train dpo", ("train dpo",), False),
              ("eval sft / dpo", ("eval sft", "eval dpo"), True),
              ("probe", ("probe sft+dpo", "probe diff", "explorer"), False),
              ("restraint", ("restraint select", "restraint bake", "restraint check"), False),
              ("eval after", ("eval dpo-restrained", "eval compare dpo-restrained"), False),
              ("restraint sweep", ("restraint sweep",), False), ("serve", ("serve",), False))
METRIC_NAMES = {"bleu": "BLEU", "rouge1": "ROUGE-1", "rouge2": "ROUGE-2", "rougeL": "ROUGE-L", "rougeLsum": "ROUGE-Lsum",
                "meteor": "METEOR", "bertscore": "BERTScore"}
PAGE_WIDTH = 115   # the page's line length


def wrapped(text: str, width: int = PAGE_WIDTH) -> str:
    """`text` in lines of at most `width`, none starting with a lone -, +, *, > or # (Markdown would read a list, a
    quote or a heading there)."""
    import textwrap

    words = text.split(" ")
    glued = [words[0]]
    for word in words[1:]:
        if word in ("-", "+", "*", ">", "#", "−"):
            glued[-1] += "\0" + word
        else:
            glued.append(word)
    lines = textwrap.wrap(" ".join(glued), width, break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines).replace("\0", " ")


def stage_times(demo: Path, summary: dict) -> dict[str, float]:
    """Seconds per stage: summary.json's `stage_seconds`; a stage this invocation reused (0.0, not in `stages_run`)
    takes the seconds stages.json kept from the invocation that ran it."""
    kept = json.loads((demo / "stages.json").read_text()) if (demo / "stages.json").is_file() else {}
    ran = set(summary.get("stages_run", []))
    return {name: seconds if name in ran or name not in kept else kept[name].get("seconds", seconds)
            for name, seconds in summary.get("stage_seconds", {}).items()}


def seconds_text(values: list[float], each: bool) -> str:
    """'18 s', '< 1 s', or for a row timed per stage '15-20 s each'."""
    def one(x: float) -> str:
        return "< 1" if x < 1 else f"{x:.0f}"

    if not each or len(values) == 1:
        return f"{one(sum(values))} s"
    low, high = one(min(values)), one(max(values))
    return f"{low} s each" if low == high else f"{low}-{high} s each"


def timings_table(times: dict[str, float]) -> list[str]:
    """The stage table's rows with this run's times, then the total."""
    rows, named = [], set()
    for row, stages, each in STAGE_ROWS:
        values = [times[s] for s in stages if s in times]
        named.update(stages)
        if values:
            rows.append(f"| {row} | {seconds_text(values, each)} |")
    rows += [f"| {name} | {seconds_text([t], False)} |" for name, t in times.items() if name not in named]
    total = sum(times.values())
    about = f"about {total / 60:.0f} min" if total >= 90 else f"{total:.0f} s"
    return ["| stage | time |", "|---|---|", *rows, "", f"The stages took {about} in all."]


def signed(x: float, digits: int) -> str:
    """'+0.036', '−0.012' (the page's minus sign)."""
    return f"{x:+.{digits}f}".replace("-", "−")


def short_e(x: float) -> str:
    """'6e-6': one significant digit, the exponent without its padding."""
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def score_words(name: str) -> str:
    """A sweep score in words: 'multi-turn passes' for judge:multi_turn, 'BLEU' for bleu."""
    from rolemrc.sweep.stats import JUDGE_PREFIX

    if name.startswith(JUDGE_PREFIX):
        return f"{name.removeprefix(JUDGE_PREFIX).replace('_', '-')} passes"
    return METRIC_NAMES.get(name, name)


def changed_responses(sweep_dir: Path, cell_id: str) -> int | None:
    """How many of a sweep cell's responses differ from the baseline's (None where the score folders are missing)."""
    from rolemrc.core.io import read_jsonl

    baseline = sorted((sweep_dir / "scores").glob("baseline-*/responses.jsonl"))
    cell = sweep_dir / "scores" / cell_id / "responses.jsonl"
    if len(baseline) != 1 or not cell.is_file():
        return None
    before = {r["id"]: r["response"] for r in read_jsonl(baseline[0])}
    return sum(before.get(r["id"]) != r["response"] for r in read_jsonl(cell))


def sweep_detail(sweep: dict, sweep_dir: Path) -> str:
    """What the paper's-factor cells did, and the baseline effects of the cell that moves logits most: its judge
    dimensions and the reference metric with the smallest p that moved, with their Holm-corrected p."""
    from rolemrc.intervene.budget import Budget
    from rolemrc.intervene.spec import PAPER_FACTOR
    from rolemrc.sweep.report import ALPHA
    from rolemrc.sweep.stats import is_primary

    cells, out = sweep["cells"], []
    if not cells:
        return ""
    paper = [c for c in cells if c["factor"] == PAPER_FACTOR]
    if paper:
        changed = [changed_responses(sweep_dir, c["id"]) for c in paper]
        text = f"The 1 - 1e-6 cells move logits by at most {short_e(max(c['max_logit_shift'] for c in paper))}"
        if None not in changed:
            text += " and change no response" if max(changed) == 0 else f" and change at most {max(changed)} responses"
        out.append(text + ".")
    strongest = max(cells, key=lambda c: c["max_logit_shift"])
    moved = {n: e["vs_baseline"] for n, e in strongest["scores"].items() if e["vs_baseline"]["diff"] != 0}
    metrics = sorted((n for n in moved if not is_primary(n)), key=lambda n: moved[n]["p"])
    shown = sorted((n for n in moved if is_primary(n)), key=lambda n: moved[n]["p"]) + metrics[:1]
    if shown and strongest["factor"] != PAPER_FACTOR:
        budget = Budget.of(strongest["budget"])
        units = {"top_k": f"the top {budget.value} units", "per_layer": f"the top {budget.value} units per layer"}.get(
            budget.kind, f"the units of {budget.label}")
        verb = "Zeroing" if strongest["factor"] == 0 else f"Scaling by {strongest['factor']:g}"
        verbs = ["raises" if moved[n]["diff"] > 0 else "lowers" for n in shown]
        effects = " and ".join(
            ("" if k and verbs[k] == verbs[k - 1] else f"{verbs[k]} ") + f"{score_words(n)} by {abs(moved[n]['diff']):.2f}"
            + (f" ({moved[n]['n']} cases)" if is_primary(n) else "") for k, n in enumerate(shown))
        tests = sum(len(c["scores"]) for c in cells)
        corrected = " and ".join(dict.fromkeys(f"{moved[n]['p_holm']:.2g}" for n in shown))
        survivors = [e for c in cells for e in c["scores"].values() if e["vs_baseline"]["p_holm"] < ALPHA]
        holm = (f"but with {sweep['items']} cases and {tests} tests per family, nothing survives Holm (corrected "
                f"p = {corrected})" if not survivors else
                f"with {sweep['items']} cases and {tests} tests per family (Holm-corrected p = {corrected})")
        out.append(f"{verb} {units} {effects} against the baseline, {holm}.")
    return " ".join(out)


def sft_dpo_comparison(demo: Path) -> dict | None:
    """`eval compare` of the run's SFT and DPO evals (as `rolemrc eval compare runs/demo/eval/sft runs/demo/eval/dpo`
    writes it); None where either eval folder lacks its per-item files."""
    from rolemrc.eval.compare import compare

    runs = [demo / "eval" / name for name in ("sft", "dpo")]
    needed = ("report.json", "responses.jsonl", "verdicts.jsonl", "metrics.jsonl")
    if not all((run / f).is_file() for run in runs for f in needed):
        return None
    return compare(*runs).to_dict()


def dpo_sentence(evals: dict, comparison: dict | None) -> str:
    """SFT's and DPO's judge average over calls, the paired change with its 95% CI (items resampled), and how the
    reference metrics moved ('' where either has no judge average)."""
    if not all(evals.get(name, {}).get("judge_avg_weighted", {}).get("mean") is not None for name in ("sft", "dpo")):
        return ""
    sft, dpo = (evals[name]["judge_avg_weighted"]["mean"] for name in ("sft", "dpo"))
    text = f"The judge average over calls is {sft:.3f} under SFT and {dpo:.3f} under DPO"
    change = (comparison or {}).get("verdicts", {}).get("all")
    if change:
        text += (f" (paired change {signed(change['diff'], 3)}, 95% CI {signed(change['lo'], 3)} to "
                 f"{signed(change['hi'], 3)})")
    names = sorted(set(evals["sft"]["metrics"]) & set(evals["dpo"]["metrics"]))
    higher = [m for m in names if evals["dpo"]["metrics"][m]["mean"] > evals["sft"]["metrics"][m]["mean"]]
    if names:
        text += (", and every reference metric is higher under DPO" if len(higher) == len(names) else
                 ", and every reference metric is lower or level under DPO" if not higher else
                 f", and {len(higher)} of {len(names)} reference metrics are higher under DPO "
                 f"({', '.join(METRIC_NAMES.get(m, m) for m in higher)})")
    return text + "."


def shift_sentence(shift: dict) -> str:
    """The dimension with the largest mean shift, its probe cases and peak layer."""
    cases = sorted({shift.get("cases_a"), shift.get("cases_b")} - {None})
    probed = f" ({' and '.join(map(str, cases))} probe cases)" if cases else ""
    return (f"The dimension with the largest mean shift is `{shift['dimension']}`{probed}, peaking at layer "
            f"{shift['peak_layer']}.")


def demo_run_block(demo: Path) -> str:
    """docs/demo.md's block from the run in `demo`: its stage times, the restraint's verdict, the sweep's headline and
    biggest effects, SFT against DPO, and the largest shift; every number read from the run's files."""
    summary = json.loads((demo / "summary.json").read_text())
    lines = [DEMO_RUN_START]
    times = stage_times(demo, summary)
    if times:
        lines += ["Stage times in this run (wall time; a stage it reused counts the time it took when it ran):", "",
                  *timings_table(times), ""]
    lines += ["The restraint's verdict, in `summary.json`:", "", "```text", wrapped(summary["conclusion"], 110), "```", ""]
    if "sweep" in summary:
        lines += ["The sweep's headline, in `results.md` and at the end of the demo's output:", "", "```text",
                  wrapped(f"Sweep: {summary['sweep']['headline']}", 110), "```", ""]
        detail = sweep_detail(summary["sweep"], demo / "sweep")
        if detail:
            lines += [wrapped(detail), ""]
    sft_dpo = dpo_sentence(summary["eval"], sft_dpo_comparison(demo))
    if sft_dpo:
        lines += [wrapped(sft_dpo), ""]
    lines += [wrapped(shift_sentence(summary["largest_shift"])), DEMO_RUN_END]
    return "\n".join(lines)


def write_demo_page(demo: Path, page: Path) -> Path:
    """Replace `page`'s block between DEMO_RUN_START and DEMO_RUN_END (markers included) by `demo_run_block(demo)`;
    the rest of the page stays as it is."""
    text = page.read_text()
    if text.count(DEMO_RUN_START) != 1 or text.count(DEMO_RUN_END) != 1:
        raise SystemExit(f"{page}: needs exactly one {DEMO_RUN_START} ... {DEMO_RUN_END} block")
    before, rest = text.split(DEMO_RUN_START)
    _, after = rest.split(DEMO_RUN_END)
    page.write_text(before + demo_run_block(demo) + after)
    return page


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("demo", type=Path, help="a `rolemrc demo --out` folder")
    parser.add_argument("--img", type=Path, default=ROOT / "docs" / "img", help="where the pictures go")
    parser.add_argument("--notebooks", type=Path, default=ROOT / "notebooks", help="where the executed notebooks go")
    parser.add_argument("--ab-requests", type=int, default=40, help="requests the A/B notebook sends (one user each)")
    parser.add_argument("--calibration", type=Path, help="a `rolemrc organism calibrate --out` folder (its chart)")
    parser.add_argument("--demo-page", type=Path, default=ROOT / "docs" / "demo.md",
                        help="the page whose demo-run block is rewritten from the run's files")
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
    written.append(write_demo_page(demo, args.demo_page))
    for path in written:
        print(f"{path.stat().st_size / 1000:7.1f} kB  {path}")


if __name__ == "__main__":
    main()
