"""The layer explorer page, loaded in headless Chromium: no console errors, clicks work."""

import json
from pathlib import Path

import pytest
from browser import browser_page
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.tiny import build_model
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


def test_explorer_page_in_headless_chromium(diff_dir, tmp_path):
    out = tmp_path / "explorer.html"
    res = CliRunner().invoke(app, ["probe", "explore", str(diff_dir), "--out", str(out)])
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
    res = CliRunner().invoke(app, ["probe", "explore", str(tmp_path), "--out", str(tmp_path / "x.html")])
    assert res.exit_code == 2 and "no diff file" in res.output
