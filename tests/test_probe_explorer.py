"""The layer explorer page: its data ranks every selector as `intervene select` does; loaded in headless Chromium:
no console errors, clicks work, a unit's top prompts show."""

import json
from pathlib import Path

import pytest
import torch
from browser import browser_page, chromium
from fixtures import write_diff_file
from train_fixtures import pair_records
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.taxonomy import TASKS
from rolemrc.core.tiny import build_model
from rolemrc.intervene.select import select
from rolemrc.intervene.spec import Restraint, RestraintError, parse_layers
from rolemrc.probe import collect, collect_paired, diff, load_diff, write_diff
from rolemrc.probe.attribution import attribute, load_attribution
from rolemrc.probe.errors import ProbeError
from rolemrc.probe.explorer import explorer_data, write_explorer

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


@pytest.fixture(scope="module")
def diff_dir(model_dirs, records, tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("explorer")
    other = root / "b-model"
    build_model("llama", tokenizer, seed=11, hidden=64, layers=2, intermediate=96).save_pretrained(other)
    tokenizer.save_pretrained(other)
    a = collect(model_dirs["llama"], records, device="cpu", progress=False)
    b = collect(other, records, device="cpu", progress=False)
    write_diff(diff(a, b), root / "diff", figures=False)
    return root / "diff"


@pytest.fixture(scope="module")
def paired_dir(model_dirs, records, tokenizer, tmp_path_factory):
    """A paired diff of two 3-layer Llamas (their top cases kept) and an attribution file of the same two models."""
    root = tmp_path_factory.mktemp("explorer-paired")
    for name, seed in (("a", 0), ("b", 11)):
        build_model("llama", tokenizer, seed=seed, hidden=64, layers=3, intermediate=96).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    write_diff(diff(collect_paired([root / "a", root / "b"], records, device="cpu", progress=False)), root / "diff",
               figures=False)
    pairs = [{**x, "task": TASKS[i % len(TASKS)]} for i, x in enumerate(pair_records(20))]
    attribute([root / "a", root / "b"], pairs, device="cpu", progress=False).save(root / "attribution.safetensors")
    return root


def preview(ranked: dict, layers: list[int] | None, direction: str, top_k: int | None) -> list[tuple[int, int]]:
    """The page's preview (templates/explorer.html previewSelect) in Python: the first top_k ranked units (every
    unit with q < fdr when top_k is None) in the layers and direction."""
    chosen = []
    for layer, unit, score, sig in zip(ranked["layer"], ranked["unit"], ranked["score"], ranked["sig"]):
        if (layers is not None and layer not in layers) or (direction == "up" and score < 0) or \
                (direction == "down" and score > 0) or (top_k is None and not sig):
            continue
        chosen.append((layer, unit))
        if len(chosen) == top_k:
            break
    return chosen


def test_every_selectors_preview_equals_what_select_picks(paired_dir):
    """For each selector: top-k up to max_units, and q < fdr where the page embeds every qualifying unit (max_units
    at least the width here), list the units `select --method` picks."""
    result, attribution = load_diff(paired_dir / "diff"), load_attribution(paired_dir / "attribution.safetensors")
    sources = {"frequency": result, "standardized": result, "attribution": attribution}
    checked = set()
    for max_units, settings in ((24, ((None, "both", 1), (None, "both", 24), ("1-2", "up", 10), ("0", "down", 7))),
                                (96, ((None, "both", None), ("0,2", "up", None), ("1", "down", None)))):
        data = explorer_data(result, max_units=max_units, attribution=attribution)
        for dim, d in data["dimensions"].items():
            assert sorted(d["selectors"]) == sorted(m for m in sources if m != "attribution" or dim in attribution.scores)
            for method, sel in d["selectors"].items():
                for layers, direction, top_k in settings:
                    if top_k is None and not sel["tested"]:
                        continue
                    try:
                        want = select(sources[method], dim, method=method, layers=layers, direction=direction,
                                      top_k=top_k, fdr=None if top_k else 0.05, factor=0.0).units
                    except RestraintError:   # no unit qualifies
                        want = {}
                    got = preview(sel["ranked"], parse_layers(layers, 3), direction, top_k)
                    assert sorted(got) == sorted((layer, unit) for layer, units in want.items() for unit in units), \
                        (dim, method, layers, direction, top_k)
                    checked.add((method, top_k is None))
    assert checked == {("frequency", False), ("frequency", True), ("standardized", False), ("standardized", True),
                       ("attribution", False)}


def test_the_page_offers_attribution_only_with_a_matching_file(paired_dir, diff_dir, tmp_path):
    result = load_diff(paired_dir / "diff")
    data = explorer_data(result)
    assert all(sorted(d["selectors"]) == ["frequency", "standardized"] for d in data["dimensions"].values())
    assert "probe attribute" in data["no_attribution"]
    with pytest.raises(ProbeError, match="attribution of mlp.act 3 x 96, but the diff is of mlp.act 2 x 96"):
        write_explorer(diff_dir, tmp_path / "x.html", attribution=paired_dir / "attribution.safetensors")


def test_the_page_embeds_the_top_prompts_of_the_units_it_shows(paired_dir):
    result = load_diff(paired_dir / "diff")
    data = explorer_data(result, max_units=4)
    prompts = data["prompts"]
    shown = {(layer, unit) for d in data["dimensions"].values() for sel in d["selectors"].values()
             for layer, units in enumerate(sel["units"]) for unit in units}
    assert {divmod(flat, 96) for flat in prompts["units"]} == shown and prompts["n"] == 5
    for row, flat in enumerate(prompts["units"]):
        layer, unit = divmod(flat, 96)
        for side in ("a", "b"):
            top, got = result.top_cases[side], prompts["sides"][side]
            assert got["cases"][row] == top.cases[layer, unit].tolist()
            assert got["values"][row] == pytest.approx(top.values[layer, unit].tolist(), rel=1e-3)
            for c in got["cases"][row]:
                assert got["texts"][c] == [top.texts[c]["id"], top.texts[c]["dimensions"], top.texts[c]["text"]]


def test_explorer_data_preview_is_exact_for_small_k(diff_dir):
    result = load_diff(diff_dir)
    data = explorer_data(result, max_units=8)
    d = data["dimensions"]["multi_turn"]["selectors"]["frequency"]
    assert len(d["units"]) == data["layers"] and all(len(u) == 8 for u in d["units"])
    embedded = sorted((abs(x) for row in d["score"] for x in row), reverse=True)[:8]
    truth = sorted(result.delta["multi_turn"].abs().reshape(-1).tolist(), reverse=True)[:8]
    assert embedded == pytest.approx(truth)


def test_the_page_from_a_diffresult_equals_the_page_from_its_folder(diff_dir, tmp_path):
    pages = [write_explorer(x, tmp_path / f"{k}.html") for k, x in enumerate((diff_dir, load_diff(diff_dir)))]
    assert pages[0].read_text() == pages[1].read_text()


@pytest.fixture(scope="module")
def browser():
    with chromium() as context:
        yield context


def test_explorer_page_in_headless_chromium(diff_dir, tmp_path, browser):
    out = tmp_path / "explorer.html"
    res = CliRunner().invoke(app, ["probe", "explore", "--diff", str(diff_dir), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["bytes"] > 1_000_000  # plotly.js inlined: works offline
    with browser_page(browser) as (page, errors):
        page.goto(out.as_uri())
        page.wait_for_function("window.explorerReady === true", timeout=20_000)
        options = page.eval_on_selector_all("#dimension option", "els => els.map(e => e.value)")
        assert options == ["knowledge_boundary", "role_style", "multi_turn", "nested", "prioritized"]
        page.select_option("#dimension", "multi_turn")
        box = page.locator("#layers .bars .point path").nth(1).bounding_box()  # a real click on bar 1
        page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] - 3)
        page.wait_for_function("document.querySelector('#scatter .gtitle').textContent.startsWith('layer 1')")
        page.fill("#pv-layers", "1")
        page.fill("#pv-topk", "5")
        summary = page.text_content("#preview-summary")
        assert summary.startswith("5 units selected") and "L1: 5" in summary
        page.select_option("#pv-direction", "up")
        rows = page.eval_on_selector_all("#preview-table tr", "rows => rows.length")
        assert rows >= 2
        assert page.eval_on_selector_all("#selector option", "els => els.map(e => e.value)") == ["frequency", "standardized"]
        assert "probe attribute" in page.text_content("#selector-note")
        assert errors == []


def test_the_page_switches_selector_and_shows_a_clicked_units_top_prompts(paired_dir, tmp_path, browser):
    out = tmp_path / "explorer.html"
    res = CliRunner().invoke(app, ["probe", "explore", "--diff", str(paired_dir / "diff"), "--out", str(out),
                                   "--attribution", str(paired_dir / "attribution.safetensors")])
    assert res.exit_code == 0, res.output
    result = load_diff(paired_dir / "diff")
    with browser_page(browser) as (page, errors):
        page.goto(out.as_uri())
        page.wait_for_function("window.explorerReady === true", timeout=20_000)
        page.select_option("#dimension", "multi_turn")
        assert page.eval_on_selector_all("#selector option", "els => els.map(e => e.value)") == \
            ["frequency", "standardized", "attribution"]
        page.select_option("#selector", "attribution")
        assert "attribution (mean score per pair)" in page.text_content("#units .g-ytitle")
        assert "mean activation A" in page.text_content("#scatter .g-xtitle")
        layer = int(page.text_content("#scatter .gtitle").split(":")[0].removeprefix("layer "))
        box = page.locator("#units .bars .point path").nth(0).bounding_box()  # a real click on the first bar
        page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.wait_for_function("document.querySelector('#prompts-title').textContent.startsWith('layer')")
        unit = int(page.text_content("#prompts-title").split("unit ")[1])
        assert page.text_content("#prompts-title") == f"layer {layer}, unit {unit}"
        shown = page.eval_on_selector_all("#prompts .side", "sides => sides.map(s => [...s.querySelectorAll('tr')]"
                                          ".slice(1).map(r => [...r.cells].map(c => c.textContent)))")
        for side, rows in zip(("a", "b"), shown):
            top = result.top_cases[side]
            assert [row[2] for row in rows] == [top.texts[c]["text"] for c in top.cases[layer, unit].tolist()]
            assert [float(row[0]) for row in rows] == pytest.approx(top.values[layer, unit].tolist(), rel=1e-3)
        page.select_option("#pv-mode", "fdr")
        assert page.text_content("#preview-summary") == "error: --method attribution has no q-values here: select with top-k"
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "explorer.png"), full_page=True)
        assert errors == []


def test_explore_refuses_missing_diff(tmp_path):
    res = CliRunner().invoke(app, ["probe", "explore", "--diff", str(tmp_path), "--out", str(tmp_path / "x.html")])
    assert res.exit_code == 2 and "is an empty folder; expected a diff folder" in res.output
    for where, why in (([str(tmp_path)], "Missing option '--diff'"),   # --diff only, no positional spelling
                       ([str(tmp_path), "--diff", str(tmp_path)], "unexpected extra argument")):
        res = CliRunner().invoke(app, ["probe", "explore", *where, "--out", str(tmp_path / "x.html")])
        assert res.exit_code == 2 and why in res.output


@pytest.fixture(scope="module")
def tied_page(tmp_path_factory):
    """A diff whose |delta| and q tie a lot (ties are broken by layer, then unit) with some q = 1e-9, and its page
    embedding 6 units per layer and sign."""
    root = tmp_path_factory.mktemp("tied")
    gen = torch.Generator().manual_seed(3)
    delta = torch.tensor([-0.5, -0.25, 0.0, 0.25, 0.5])[torch.randint(0, 5, (4, 24), generator=gen)]
    q = torch.tensor([1e-9, 0.01, 0.5, 0.5, 0.5, 0.5])[torch.randint(0, 6, (4, 24), generator=gen)]
    write_diff_file(root / "diff", delta, q)
    res = CliRunner().invoke(app, ["probe", "explore", "--diff", str(root / "diff"), "--out", str(root / "page.html"), "--max-units", "6"])
    assert res.exit_code == 0, res.output
    return root


def page_preview(page, layers: str, direction: str, mode: str, top_k: int) -> tuple[str, list[tuple[int, int]], list[str]]:
    """Set the preview's controls; return its summary line, the (layer, unit) rows it lists and their q column."""
    page.fill("#pv-layers", layers)
    page.select_option("#pv-direction", direction)
    page.select_option("#pv-mode", mode)
    page.fill("#pv-topk", str(top_k))
    rows = page.eval_on_selector_all("#preview-table tr", "rows => rows.slice(1).map(r => [...r.cells].map(c => c.textContent))")
    return page.text_content("#preview-summary"), [(int(r[0]), int(r[1])) for r in rows], [r[3] for r in rows]


def select_units(diff_dir: Path, out: Path, layers: str, direction: str, mode: str, top_k: int) -> set | str:
    """`rolemrc intervene select` for the same settings: the spec file's units, or the error line."""
    how = ["--top-k", str(top_k)] if mode == "top_k" else ["--fdr", "0.05"]
    res = CliRunner().invoke(app, ["intervene", "select", "--diff", str(diff_dir), "--dimension", "multi_turn",
                                   "--method", "frequency", "--factor", "0", "--direction", direction, *(["--layers", layers] if layers else []), *how, "--out", str(out)])
    if res.exit_code != 0:
        return res.output
    return {(layer, unit) for layer, units in Restraint.load(out).units.items() for unit in units}


SETTINGS = [("", "both", "top_k", 1), ("", "both", "top_k", 6), ("", "up", "top_k", 5), ("", "down", "top_k", 6),
            ("1-2", "both", "top_k", 6), ("0,3", "down", "top_k", 4), (" 2 ", "up", "top_k", 3),
            ("", "both", "fdr", 0), ("1", "up", "fdr", 0), ("0-1,3", "down", "fdr", 0)]


def test_explorer_preview_lists_what_select_selects(tied_page, tmp_path, browser):
    with browser_page(browser) as (page, errors):
        page.goto((tied_page / "page.html").as_uri())
        page.wait_for_function("window.explorerReady === true", timeout=20_000)
        for n, (layers, direction, mode, top_k) in enumerate(SETTINGS):
            summary, listed, _ = page_preview(page, layers, direction, mode, top_k)
            chosen = select_units(tied_page / "diff", tmp_path / f"s{n}.yaml", layers, direction, mode, top_k)
            assert set(listed) == chosen and len(listed) == len(chosen), (layers, direction, mode, top_k, summary)
            assert summary.startswith(f"{len(chosen)} units selected ·")
        for layers in ("2-9", "4", "1,x", "3-1"):  # refused on both sides: an error, nothing listed
            summary, listed, _ = page_preview(page, layers, "both", "top_k", 3)
            refusal = select_units(tied_page / "diff", tmp_path / "refused.yaml", layers, "both", "top_k", 3)
            assert isinstance(refusal, str) and summary.startswith("error: ") and listed == []
            assert summary.removeprefix("error: ") in refusal
        assert errors == []


def test_explorer_parse_layers_refuses_what_python_refuses(tied_page, browser):
    texts = ["", " all ", "all", "ALL", "1", "0-3", "3-0", "1,,2", "1,", ",1", "-1", "1-", "-", "+1", "1_0", "1__0", "_1",
             " 1 - 2 ", "1\t-\u30002", "\u00a01", "\ufeff1", "\x1c1", "\uff10-\uff12", "\u0663", "\U0001d7d92", "1--2",
             "0--0", "1-2-3", "1 2", "1.0", "1e1", "0x1", "99999999999999999999", "4", "3", "0-3,2-3", "11", "0-11", "12"]
    gen = torch.Generator().manual_seed(0)
    alphabet = "0123 -,+_\t"
    texts += ["".join(alphabet[i] for i in torch.randint(0, len(alphabet), (int(n),), generator=gen))
              for n in torch.randint(1, 7, (300,), generator=gen)]
    with browser_page(browser) as (page, errors):
        page.goto((tied_page / "page.html").as_uri())
        page.wait_for_function("window.explorerReady === true", timeout=20_000)
        for n in (4, 12):
            js = page.evaluate("([texts, n]) => texts.map(t => { try { return parseLayers(t, n); } catch (e) { return 'error: ' + e.message; } })",
                               [texts, n])
            for text, got in zip(texts, js):
                try:
                    want = parse_layers(text, n)
                except RestraintError as e:
                    assert isinstance(got, str) and got.startswith("error: "), (text, n, got, str(e))
                    continue
                assert got == want, (text, n, got)
        assert errors == []


def test_explorer_shows_a_tiny_q_with_its_digits(tied_page, browser):
    data = explorer_data(load_diff(tied_page / "diff"), max_units=6)["dimensions"]["multi_turn"]["selectors"]["frequency"]
    assert 1e-9 in data["ranked"]["q"] and all(q > 0 for row in data["q"] for q in row)
    with browser_page(browser) as (page, errors):
        page.goto((tied_page / "page.html").as_uri())
        page.wait_for_function("window.explorerReady === true", timeout=20_000)
        _, listed, qs = page_preview(page, "", "both", "fdr", 0)
        assert listed and "1.00e-9" in qs and not any(q.startswith("0.00") for q in qs)
        assert errors == []
