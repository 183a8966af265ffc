"""The layer explorer page, loaded in headless Chromium: no console errors, clicks work."""

import json
from pathlib import Path

import pytest
import torch
from browser import browser_page
from fixtures import write_diff_file
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.tiny import build_model
from rolemrc.intervene.spec import Restraint, RestraintError, parse_layers
from rolemrc.probe import collect, diff, write_diff
from rolemrc.probe.explorer import explorer_data

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


def test_explorer_data_preview_is_exact_for_small_k(diff_dir):
    from rolemrc.probe import load_diff

    result = load_diff(diff_dir)
    data = explorer_data(result, max_units=8)
    d = data["dimensions"]["multi_turn"]
    assert len(d["units"]) == data["layers"] and all(len(u) == 8 for u in d["units"])
    embedded = sorted((abs(x) for row in d["delta"] for x in row), reverse=True)[:8]
    truth = sorted(result.delta["multi_turn"].abs().reshape(-1).tolist(), reverse=True)[:8]
    assert embedded == pytest.approx(truth)


def test_the_page_from_a_diffresult_equals_the_page_from_its_folder(diff_dir, tmp_path):
    from rolemrc.probe import load_diff
    from rolemrc.probe.explorer import write_explorer

    pages = [write_explorer(x, tmp_path / f"{k}.html") for k, x in enumerate((diff_dir, load_diff(diff_dir)))]
    assert pages[0].read_text() == pages[1].read_text()


def test_explorer_page_in_headless_chromium(diff_dir, tmp_path):
    out = tmp_path / "explorer.html"
    res = CliRunner().invoke(app, ["probe", "explore", "--diff", str(diff_dir), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["bytes"] > 1_000_000  # plotly.js inlined: works offline
    with browser_page() as (page, errors):
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


def test_explorer_preview_lists_what_select_selects(tied_page, tmp_path):
    with browser_page() as (page, errors):
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


def test_explorer_parse_layers_refuses_what_python_refuses(tied_page):
    texts = ["", " all ", "all", "ALL", "1", "0-3", "3-0", "1,,2", "1,", ",1", "-1", "1-", "-", "+1", "1_0", "1__0", "_1",
             " 1 - 2 ", "1\t-\u30002", "\u00a01", "\ufeff1", "\x1c1", "\uff10-\uff12", "\u0663", "\U0001d7d92", "1--2",
             "0--0", "1-2-3", "1 2", "1.0", "1e1", "0x1", "99999999999999999999", "4", "3", "0-3,2-3", "11", "0-11", "12"]
    gen = torch.Generator().manual_seed(0)
    alphabet = "0123 -,+_\t"
    texts += ["".join(alphabet[i] for i in torch.randint(0, len(alphabet), (int(n),), generator=gen))
              for n in torch.randint(1, 7, (300,), generator=gen)]
    with browser_page() as (page, errors):
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


def test_explorer_shows_a_tiny_q_with_its_digits(tied_page):
    from rolemrc.probe import load_diff

    data = explorer_data(load_diff(tied_page / "diff"), max_units=6)["dimensions"]["multi_turn"]
    assert 1e-9 in data["ranked"]["q"] and all(q > 0 for row in data["q"] for q in row)
    with browser_page() as (page, errors):
        page.goto((tied_page / "page.html").as_uri())
        page.wait_for_function("window.explorerReady === true", timeout=20_000)
        _, listed, qs = page_preview(page, "", "both", "fdr", 0)
        assert listed and "1.00e-9" in qs and not any(q.startswith("0.00") for q in qs)
        assert errors == []
