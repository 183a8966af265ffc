"""The restraint sweep's plan, resumable generation and statistics (issue 17, first part)."""

import importlib
import json
import math

import pytest
from fixtures import write_sweep_inputs
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.stats import holm
from rolemrc.eval.runs import EvalRun
from rolemrc.sweep.plan import SweepConfig, plan
from rolemrc.sweep.plots import dose_response
from rolemrc.sweep.run import generate_cells, run_sweep
from rolemrc.sweep.stats import cell_effects, correct_grid, item_scores


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer):
    """A peaked small Llama (clear greedy margins), a diff over its mlp.act units, six test records."""
    root = tmp_path_factory.mktemp("sweep")
    write_sweep_inputs(root, tokenizer, 6)
    return root


class Killed(Exception):
    """The sweep process dying between two passes."""


def config(root, out, **kw):
    return SweepConfig(model=str(root / "model"), diff=str(root / "diff"), data=str(root / "test.jsonl"), out=str(out),
                       dimensions=["multi_turn"], **{"method": "frequency", "factors": [0.5, 0.0], "top_k": [8], "controls": 2,
                                                     "max_new_tokens": 6, "batch_size": 8, "cells_per_pass": 2, **kw})


def test_plan_has_a_baseline_then_each_cell_with_its_controls(setup, tmp_path):
    cells = plan(config(setup, tmp_path, top_k=[4, 8]), width=96, settings={"model": "m"})
    assert [c.kind for c in cells] == ["baseline"] + ["selected", "control", "control"] * 4
    assert len({c.id for c in cells}) == len(cells)
    for cell in cells[1:]:
        assert cell.restraint.factor == cell.grid["factor"] and cell.restraint.num_units == cell.grid["budget"]["top_k"]
    selected, control = cells[1], cells[2]
    assert all(not set(control.restraint.units.get(layer, ())) & set(units)
               for layer, units in selected.restraint.units.items())
    assert control.restraint.source["bins"] == 10 and "mean_b" in control.restraint.source["matched_on"]   # the diff's
    assert plan(config(setup, tmp_path, top_k=[4, 8]), width=96, settings={"model": "other"})[1].id != selected.id


def test_generation_is_resumable_and_a_killed_sweep_ends_identical(setup, tmp_path, monkeypatch):
    whole_cells, whole = generate_cells(config(setup, tmp_path / "whole"), progress=False)
    assert len(whole_cells) == 1 + 2 * 3 and all(whole.done(c) for c in whole_cells)
    responses = {c.id: [r["response"] for r in whole.load(c)] for c in whole_cells}
    assert all(len(v) == 6 for v in responses.values())
    baseline = responses[whole_cells[0].id]
    ablated = next(c for c in whole_cells if c.kind == "selected" and c.grid["factor"] == 0.0)
    assert responses[ablated.id] != baseline   # zeroing 8 of 192 units moves this peaked model's greedy text
    matching = json.loads((tmp_path / "whole" / "plan.json").read_text())["controls"]
    assert matching["per_cell"] == 2 and set(matching["matched_on"]) == {"multi_turn"}
    prints = json.loads((tmp_path / "whole" / "footprints.json").read_text())
    assert set(prints) == {c.id for c in whole_cells[1:]}
    assert prints[ablated.id]["units"] == 8 and prints[ablated.id]["weight_elements_changed"] == 8 * 64
    assert prints[ablated.id]["max_logit_shift"] > 0.1

    generate_module = importlib.import_module("rolemrc.eval.generate")   # rolemrc.eval.generate is also a function
    real, passes, kill_at = generate_module.generate_rows, [], [2]

    def counted(*args, **kw):   # the second pass of the first attempt dies
        passes.append(len(args[2]))
        if len(passes) == kill_at[0]:
            raise Killed
        return real(*args, **kw)

    monkeypatch.setattr(generate_module, "generate_rows", counted)
    with pytest.raises(Killed):
        generate_cells(config(setup, tmp_path / "killed"), progress=False)
    kept = sorted(p.name for p in (tmp_path / "killed" / "cells").glob("*.jsonl"))
    assert len(kept) == 2 and not list((tmp_path / "killed" / "cells").glob("*.tmp"))
    passes.clear()
    kill_at[0] = 0
    cells, store = generate_cells(config(setup, tmp_path / "killed"), progress=False)
    assert sum(passes) == 6 * (len(cells) - 2)   # only the cells not kept were generated again
    assert {c.id: [r["response"] for r in store.load(c)] for c in cells} == responses
    assert json.loads((tmp_path / "killed" / "plan.json").read_text())["cells"][0]["kind"] == "baseline"


def test_holm_matches_the_step_down_by_hand():
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.4]) == pytest.approx([0.8, 0.8])       # monotone: the larger p is never adjusted below
    adjusted = holm([0.01, float("nan"), 0.02])
    assert adjusted[0] == pytest.approx(0.02) and math.isnan(adjusted[1]) and adjusted[2] == pytest.approx(0.02)


def run(passes: list[int], bleu: list[float]) -> dict[str, dict[str, float]]:
    """The item scores of a run with these verdicts and BLEU values."""
    ids = [f"i{k}" for k in range(len(passes))]
    return item_scores(EvalRun(items=[{"id": i} for i in ids], metrics=[{"id": i, "bleu": b} for i, b in zip(ids, bleu)],
                               verdicts=[{"id": i, "dimension": "multi_turn", "score": s} for i, s in zip(ids, passes)]))


def test_effects_against_baseline_and_controls_are_paired_and_corrected():
    n = 12
    baseline, controls = run([0] * n, [1.0] * n), [run([0] * n, [1.0] * n), run([1] + [0] * (n - 1), [1.0] * n)]
    planted = cell_effects(baseline, run([1] * n, [1.0] * n), controls)
    judge = planted["judge:multi_turn"]
    assert judge["mean"] == 1 and judge["vs_baseline"]["diff"] == 1 and judge["vs_baseline"]["p"] < 0.001
    assert judge["vs_controls"]["diff"] == pytest.approx(1 - 1 / (2 * n)) and judge["vs_controls"]["p"] < 0.001
    assert planted["bleu"]["vs_baseline"]["diff"] == 0 and planted["bleu"]["vs_baseline"]["p"] == 1
    assert judge["placement"]["percentile"] == 100 and judge["placement"]["lo"] > 0 and judge["placement"]["k"] == 2
    like_controls = cell_effects(baseline, run([1] + [0] * (n - 1), [1.0] * n), controls)["judge:multi_turn"]
    assert like_controls["vs_controls"]["diff"] == pytest.approx(1 / (2 * n)) and like_controls["vs_controls"]["p"] == 1
    assert like_controls["placement"]["percentile"] == 75   # above one control, tied with the other
    effects = {"planted": planted, "like-controls": {"judge:multi_turn": like_controls}}
    correct_grid(effects)
    family = [planted["judge:multi_turn"], planted["bleu"], like_controls]
    assert [e["vs_baseline"]["p_holm"] for e in family] == pytest.approx(
        holm([e["vs_baseline"]["p"] for e in family]))
    assert planted["judge:multi_turn"]["vs_controls"]["p_holm"] < 0.05
    assert judge["lo"] == judge["hi"] == 1   # every case passes: the bootstrap CI over cases has nothing to vary
    assert like_controls["lo"] == 0 < like_controls["mean"] < like_controls["hi"]
    assert like_controls["controls_lo"] == 0 < like_controls["controls_mean"] == 1 / (2 * n) < like_controls["controls_hi"]


def test_the_dose_response_draws_every_cells_95_ci_and_its_controls_band():
    n = 12
    baseline, controls = run([0] * n, [1.0] * n), [run([1, 0] * (n // 2), [1.0] * n), run([0] * n, [1.0] * n)]
    cells = [{"dimension": "multi_turn", "budget": {"top_k": k}, "units": k, "factor": f,
              "scores": cell_effects(baseline, run([1, 1, 0] * (n // 3), [1.0] * n), controls, rounds=500)}
             for k, factors in ((8, [0.5, 0.0]), (64, [0.0])) for f in factors]   # a budget of one factor: bars alone
    fig = dose_response({"config": {"measure": "judge", "controls": 2}, "baseline": {"judge:multi_turn": 0.0},
                         "cells": cells}, "multi_turn")
    bands = [t for t in fig.data if t.fill == "toself"]
    lines = [t for t in fig.data if t.fill != "toself"]
    assert [t.name for t in bands] == [t.name + ": 95% CI" for t in lines] == [
        "random-unit controls (mean of 2 draws): 95% CI", "selected units: 95% CI"] * 2
    for band, line in zip(bands, lines):
        assert max(band.y) > min(band.y) and band.fillcolor.startswith("rgba(")   # a band of some height, see-through
        assert all(up > 0 and down > 0 for up, down in zip(line.error_y.array, line.error_y.arrayminus))
    assert "95% bootstrap CI over cases" in fig.layout.title.subtitle.text and "grey: random-unit controls" in \
        fig.layout.title.subtitle.text
    assert [a.text for a in fig.layout.annotations][:2] == ["top-8 (8 units)", "top-64 (64 units)"]
    controls, selected = lines[:2]   # the controls drawn beside the cells (their CIs are equal here), hovering the factor
    assert list(selected.x) == [0.0, 0.5] and all(c > s for c, s in zip(controls.x, selected.x))
    assert [row[0] for row in controls.customdata] == [0.0, 0.5]


def test_a_factor_one_grid_finds_nothing_and_says_so(setup, tmp_path):
    summary = run_sweep(config(setup, tmp_path, factors=[1.0]), metrics=("rouge",), progress=False)
    (cell,) = summary["cells"]
    assert cell["weight_elements_changed"] == 0 and cell["max_logit_shift"] == 0
    assert all(e["vs_baseline"]["diff"] == 0 and e["vs_baseline"]["p_holm"] == 1 for e in cell["scores"].values())
    assert summary["headline"].startswith("No cell beats both") and "0 of 1 cells differ" in summary["headline"]
    markdown = (tmp_path / "sweep.md").read_text()
    assert summary["headline"] in markdown and "| multi_turn top-8 x1 | 8 units (4.17% of 192): 4 per layer | 0 | 0 |" in markdown
    assert "## Place among the controls" in markdown and "p50 of 2, +0.000 [+0.000, +0.000]" in markdown   # x1: all alike
    assert json.loads((tmp_path / "sweep.json").read_text())["cells"][0]["id"] == cell["id"]


def test_a_rerun_of_a_finished_sweep_generates_and_scores_nothing(setup, tmp_path, monkeypatch):
    monkeypatch.setenv("ROLEMRC_PNG", "1")
    first = run_sweep(config(setup, tmp_path), metrics=("rouge",), progress=False)
    assert len(first["cells"]) == 2 and {"judge:" in n for n in first["cells"][0]["scores"]} == {True, False}
    assert set(first["figures"]) == {"effects_vs_baseline", "effects_vs_controls", "dose_multi_turn"}
    dose = (tmp_path / "dose_multi_turn.html").read_text()
    assert "random-unit controls (mean of 2 draws): 95% CI" in dose and "selected units: 95% CI" in dose
    assert '"fill":"toself"' in dose and "baseline" in dose and (tmp_path / "dose_multi_turn.png").stat().st_size > 5000
    generate_module = importlib.import_module("rolemrc.eval.generate")
    runs_module = importlib.import_module("rolemrc.eval.runs")
    monkeypatch.setattr(generate_module, "generate_rows", lambda *a, **k: pytest.fail("generated again"))
    monkeypatch.setattr(runs_module, "score", lambda *a, **k: pytest.fail("scored again"))
    assert run_sweep(config(setup, tmp_path), metrics=("rouge",), progress=False) == first


def test_cli_sweep_writes_the_tables(setup, tmp_path):
    result = CliRunner().invoke(app, ["sweep", "run", "--model", str(setup / "model"), "--diff", str(setup / "diff"),
                                      "--data", str(setup / "test.jsonl"), "--out", str(tmp_path), "--dimension",
                                      "multi_turn", "--method", "frequency", "--factors", "0,0.5", "--top-k", "4", "--controls", "1",
                                      "--metrics", "rouge", "--max-new-tokens", "4", "--limit", "3"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["cells"] == 2 and (tmp_path / "sweep.md").is_file()
    sweep = json.loads((tmp_path / "sweep.json").read_text())   # --limit: the first 3 cases, recorded
    reports = [json.loads(f.read_text()) for f in (tmp_path / "scores").glob("*/report.json")]
    assert sweep["config"]["limit"] == 3 and reports and all(r["n_items"] == 3 for r in reports)
    bad = CliRunner().invoke(app, ["sweep", "run", "--model", str(setup / "model"), "--diff", str(setup / "diff"),
                                   "--data", str(setup / "test.jsonl"), "--out", str(tmp_path / "x"), "--dimension",
                                   "multi_turn", "--method", "frequency", "--factors", "half"])
    assert bad.exit_code != 0 and "comma-separated numbers" in bad.output


def test_a_direction_sweep_runs_its_cells_and_random_direction_controls(setup, tmp_path):
    """`--kind direction`: per budget the diff's normalised mean difference in its top layers (a budget reaching no
    further layer is left out: the model has 2), each against random unit directions in the same layers; sweep.json
    and sweep.md say what each cell restrains."""
    import torch

    from rolemrc.intervene import Restraint
    from rolemrc.probe.diff import load_diff

    summary = run_sweep(config(setup, tmp_path, kind="direction", method=None, top_k=None, factors=[0.0],
                               top_layers=[1, 2, 4]), metrics=("rouge",), progress=False)
    cells = json.loads((tmp_path / "plan.json").read_text())["cells"]
    assert [c["kind"] for c in cells] == ["baseline"] + ["selected", "control", "control"] * 2
    diff = load_diff(setup / "diff")
    delta = (diff.mean_b["multi_turn"] - diff.mean_a["multi_turn"]).double()
    longest = int(delta.norm(dim=1).argmax())
    restraints = [Restraint.from_dict(c["restraint"]) for c in cells[1:]]
    assert [r.sites for r in restraints] == [[longest]] * 3 + [[0, 1]] * 3
    for layer in (0, 1):
        torch.testing.assert_close(torch.tensor(restraints[3].directions[layer], dtype=torch.float64),
                                   delta[layer] / delta[layer].norm())
    controls = [r for r, c in zip(restraints, cells[1:]) if c["kind"] == "control"]
    assert all(r.kind == "direction" and r.source["control_of"] for r in controls)
    assert len({r.digest for r in restraints}) == 6   # every control its own random direction
    assert [c["budget"] for c in summary["cells"]] == [{"top_layers": 1}, {"top_layers": 2}]
    assert summary["cells"][1]["layers"] == [0, 1] and summary["cells"][1]["max_logit_shift"] > 0
    assert json.loads((tmp_path / "sweep.json").read_text())["cells"][1]["id"] == summary["cells"][1]["id"]
    markdown = (tmp_path / "sweep.md").read_text()
    assert "| multi_turn 2 layers x0 | a direction in layers [0, 1] |" in markdown
    assert "a random unit direction in each of the same layers" in markdown
    assert "a random unit direction" in json.loads((tmp_path / "plan.json").read_text())["controls"]["how"]


@pytest.mark.parametrize(("extra", "says"), [
    (["--kind", "revert"], "--kind revert: a revert has no runtime hook"),
    (["--kind", "direction"], "--kind direction takes the diff's difference of means"),   # with the template's --method
    (["--kind", "direction", "--top-k", "4"], "--kind direction's budgets are --top-layers, not --top-k"),
    (["--kind", "direction", "--factors", "0.5"], "--kind direction projects its direction out, a factor-less"),
    (["--top-layers", "2"], "--top-layers is --kind direction's"),
])
def test_sweep_kinds_refuse_what_is_not_theirs_in_one_line(setup, tmp_path, extra, says):
    args = ["sweep", "run", "--model", str(setup / "model"), "--diff", str(setup / "diff"), "--data",
            str(setup / "test.jsonl"), "--dimension", "multi_turn", "--method", "frequency", "--out", str(tmp_path / "s")]
    if extra[:2] == ["--kind", "direction"] and len(extra) > 2:
        args.remove("--method"), args.remove("frequency")
    result = CliRunner().invoke(app, [*args, *extra])
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1 and says in errors[0], result.output
    assert "rolemrc sweep frontier" in errors[0] or extra[:2] != ["--kind", "revert"]
    assert not (tmp_path / "s").exists()
