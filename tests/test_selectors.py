"""Unit selectors (intervene/select.py): each picks the units it should on a constructed diff or attribution file,
ties fall by layer then unit, every selector writes the same restraint spec with its method recorded, bad input is
one `error:` line with exit 2 before torch loads, and the sweep passes its method through."""

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.artifacts import stamp
from rolemrc.core.errors import RolemrcError
from rolemrc.intervene import SELECTORS, Restraint, select
from rolemrc.intervene.budget import BUDGET_HELP
from rolemrc.probe.attribution import load_attribution
from rolemrc.probe.counts import write_tensors
from rolemrc.probe.diff import DiffResult

DELTA = torch.tensor([[0.9, -0.8, 0.1, 0.0], [0.0, 0.5, -0.95, 0.2], [0.3, 0.0, 0.0, -0.4]])
EFFECT = torch.tensor([[0.1, 0.2, 3.0, -0.1], [-2.5, 0.0, 0.3, 1.0], [0.0, 4.0, -0.2, 0.05]])
# mean attribution per unit, with ties at 0.5 across layers
ATTRIBUTION = torch.tensor([[0.5, -0.5, 0.25, 0.0], [0.5, 0.5, -1.0, 0.0], [-0.5, 0.0, 0.0, 0.75]])


def write_diff(path, tokens="last", effect_test="paired-t", delta=DELTA, effect=EFFECT):
    """A diff directory (written by DiffResult.save) with one dimension, multi_turn: frequency delta and q, and the
    standardized effect with its test's q (NaN without a test)."""
    d = "multi_turn"
    q = torch.where(delta.abs() > 0.45, 0.001, 0.5).double()
    effect_q = torch.where(effect.abs() > 0.9, 1e-4, 0.6).double()
    if effect_test == "none":
        effect_q = torch.full_like(effect_q, torch.nan)
    tables = [{d: t.clone()} for t in (torch.zeros_like(delta), delta, delta, delta, q, q)]   # separate tensors
    result = DiffResult(*tables, meta={
        "hook": "mlp.act", "layers": "3", "width": "4", "k": "1", "top_fraction": "0.2", "tokens": tokens,
        "rank": "signed", "generation_prompt": "true", "test": "mcnemar", "effect_test": effect_test},
        cases_a={d: 10}, cases_b={d: 10}, mean_a={d: torch.zeros_like(effect)}, mean_b={d: effect.clone()},
        effect={d: effect.clone()}, effect_t={d: effect.clone()}, effect_p={d: effect_q.clone()}, effect_q={d: effect_q})
    result.save(path)
    return path


def write_attribution(path, scores=ATTRIBUTION, pairs=4, **meta):
    """An attribution file in the attribution branch's format: sums over pairs in units of 2^-32."""
    sums = (scores.double() * pairs * 2.0 ** 32).round().long()
    meta = {**stamp("attribution"), "hook": "mlp.act", "width": "4", "layers": "3", "models": json.dumps(["sft", "dpo"]),
            "dimensions": json.dumps(["multi_turn", "nested"]), **meta}
    return write_tensors(path, {"attribution.multi_turn": sums, "pairs.multi_turn": torch.tensor(pairs),
                                "attribution.nested": torch.zeros_like(sums), "pairs.nested": torch.tensor(0),
                                "case_hashes": torch.arange(pairs)}, meta)


def test_registry_lists_every_selector_with_its_metadata():
    assert SELECTORS.names() == ("frequency", "frequency-all", "standardized", "attribution")
    assert {SELECTORS.get(n).reads for n in SELECTORS.names()} == {"diff", "attribution"}
    assert all(SELECTORS.get(n).description and SELECTORS.get(n).ranks for n in SELECTORS.names())
    with pytest.raises(RolemrcError, match="unknown selector 'nope'; choose from frequency, frequency-all"):
        select("anything", "multi_turn", method="nope", factor=0.0, top_k=3)


def test_frequency_is_todays_selection(tmp_path):
    diff = write_diff(tmp_path / "d")
    r = select(diff, "multi_turn", method="frequency", factor=0.0, top_k=3)
    assert r.units == {0: [0, 1], 1: [2]} and r.hook == "mlp.act"
    assert r.source == {"diff": str(diff / "diff.safetensors"), "method": "frequency", "dimension": "multi_turn",
                        "direction": "both", "layers": "all", "top_k": 3,
                        "coverage": {"units": 3, "share": 0.25, "of": 12,
                                     "per_layer": {"min": 0, "median": 1.0, "max": 2, "list": [2, 1, 0]}}}
    assert select(diff, "multi_turn", method="frequency", factor=0.0, fdr=0.05).num_units == 4
    assert select(diff, "multi_turn", method="frequency", factor=0.0, top_k=2, direction="up").units == {0: [0], 1: [1]}
    all_tokens = write_diff(tmp_path / "a", tokens="all")
    assert select(all_tokens, "multi_turn", method="frequency-all", factor=0.0, top_k=3).units == r.units
    with pytest.raises(RolemrcError, match=r"a/diff.safetensors: a diff of tokens=all probe files.*--method frequency "
                                           r"reads tokens=last.*use --method frequency-all.*probe collect --tokens last"):
        select(all_tokens, "multi_turn", method="frequency", factor=0.0, top_k=3)
    with pytest.raises(RolemrcError, match=r"d/diff.safetensors: a diff of tokens=last.*use --method frequency,.*--tokens all"):
        select(diff, "multi_turn", method="frequency-all", factor=0.0, top_k=3)


def test_standardized_ranks_by_effect_and_tests_with_its_q(tmp_path):
    diff = write_diff(tmp_path / "d")
    r = select(diff, "multi_turn", method="standardized", factor=0.0, top_k=3)
    assert r.units == {0: [2], 1: [0], 2: [1]} and r.source["method"] == "standardized"
    assert select(diff, "multi_turn", method="standardized", factor=0.0, top_k=3, direction="up").units == {0: [2], 1: [3], 2: [1]}
    assert select(diff, "multi_turn", method="standardized", factor=0.0, top_k=2, direction="down").units == {1: [0], 2: [2]}
    assert select(diff, "multi_turn", method="standardized", factor=0.0, fdr=0.05).units == {0: [2], 1: [0, 3], 2: [1]}
    assert select(diff, "multi_turn", method="standardized", factor=0.0, top_k=2, layers="1-2").units == {1: [0], 2: [1]}
    untested = write_diff(tmp_path / "u", tokens="all", effect_test="none")
    assert select(untested, "multi_turn", method="standardized", factor=0.0, top_k=1).units == {2: [1]}
    with pytest.raises(RolemrcError, match="u/diff.safetensors: --method standardized has no q-values here.*exactly one of --top-k/--per-layer/--share/--fdr but --fdr"):
        select(untested, "multi_turn", method="standardized", factor=0.0, fdr=0.05)


def test_attribution_ranks_by_mean_score_with_ties_by_layer_then_unit(tmp_path):
    path = write_attribution(tmp_path / "attr.safetensors")
    loaded = load_attribution(path)
    scores, meta = loaded.scores, loaded.meta
    assert set(scores) == {"multi_turn"} and meta["hook"] == "mlp.act"   # nested has no pairs
    torch.testing.assert_close(scores["multi_turn"], ATTRIBUTION.double(), rtol=0, atol=1e-12)
    r = select(path, "multi_turn", method="attribution", factor=0.0, top_k=4)
    assert r.units == {0: [0, 1], 1: [2], 2: [3]}   # 1.0, 0.75, then the first two 0.5s: (0, 0), (0, 1)
    assert r.source["attribution"] == str(path) and r.source["method"] == "attribution" and "diff" not in r.source
    assert select(path, "multi_turn", method="attribution", factor=0.0, top_k=3, direction="up").units == {0: [0], 1: [0], 2: [3]}
    assert select(path, "multi_turn", method="attribution", factor=0.0, top_k=2, direction="down").units == {0: [1], 1: [2]}
    again = [select(path, "multi_turn", method="attribution", factor=0.0, top_k=k).to_dict() for k in (4, 4)]
    assert again[0] == again[1] == r.to_dict()
    with pytest.raises(RolemrcError, match="has no q-values here .attribution scores carry no test"):
        select(path, "multi_turn", method="attribution", factor=0.0, fdr=0.05)
    with pytest.raises(RolemrcError, match="'nested' is not in the attribution file.*no pairs"):
        select(path, "nested", method="attribution", factor=0.0, top_k=2)
    diff = write_diff(tmp_path / "d")
    with pytest.raises(RolemrcError, match="is a diff folder .from `rolemrc probe diff`.; expected an attribution file"):
        select(diff, "multi_turn", method="attribution", factor=0.0, top_k=2)
    with pytest.raises(RolemrcError, match="is an attribution file .from `rolemrc probe attribute`.; expected a diff folder"):
        select(path, "multi_turn", method="frequency", factor=0.0, top_k=2)
    with pytest.raises(RolemrcError, match="other.safetensors is a safetensors weights file; expected an attribution file"):
        select(write_attribution(tmp_path / "other.safetensors", kind="other"), "multi_turn", method="attribution", factor=0.0, top_k=2)


def test_every_selector_writes_the_same_kind_of_spec(tmp_path):
    diff, attr = write_diff(tmp_path / "d"), write_attribution(tmp_path / "a.safetensors")
    for method in ("frequency", "standardized", "attribution"):
        r = select(attr if method == "attribution" else diff, "multi_turn", method=method, top_k=3, factor=0.5, name="x")
        again = Restraint.load(r.save(tmp_path / f"{method}.yaml"))
        assert again.to_dict() == r.to_dict() and again.num_units == 3 and again.factor == 0.5


def test_selectors_take_the_loaded_objects_as_well_as_paths(tmp_path):
    """A DiffResult or an Attribution selects the same units as its file; the spec says it came from memory."""
    from rolemrc.probe import load_diff

    diff, attr = write_diff(tmp_path / "d"), write_attribution(tmp_path / "a.safetensors")
    for method, path, loaded in (("frequency", diff, load_diff(diff)), ("standardized", diff, load_diff(diff)),
                                 ("attribution", attr, load_attribution(attr))):
        from_path, from_object = (select(x, "multi_turn", method=method, factor=0.0, top_k=3) for x in (path, loaded))
        assert from_object.units == from_path.units and from_object.hook == from_path.hook, method
        assert from_object.source[SELECTORS.get(method).reads] == "in memory", method
    with pytest.raises(RolemrcError, match="reads an attribution .* not a DiffResult"):
        select(load_diff(diff), "multi_turn", method="attribution", factor=0.0, top_k=3)
    with pytest.raises(RolemrcError, match="reads a probe diff .* not an Attribution: use method='attribution'"):
        select(load_attribution(attr), "multi_turn", method="frequency", factor=0.0, top_k=3)
    with pytest.raises(RolemrcError, match="'nested' is not in the Attribution .or has no pairs"):
        select(load_attribution(attr), "nested", method="attribution", factor=0.0, top_k=3)


def run_cli(*args):
    res = CliRunner().invoke(app, ["intervene", "select", *map(str, args)])
    return res.exit_code, res.output


def test_cli_methods_and_one_line_errors(tmp_path):
    diff = write_diff(tmp_path / "d")
    code, out = run_cli("--diff", diff, "--dimension", "multi_turn", "--method", "standardized", "--top-k", 3,
                        "--factor", 0, "--out", tmp_path / "s.yaml")
    assert code == 0, out
    printed = json.loads(out)
    assert printed["method"] == "standardized" and printed["share"] == 0.25
    assert printed["units_per_layer"] == {"min": 1, "median": 1.0, "max": 1} and printed["per_layer"] == {"0": 1, "1": 1, "2": 1}
    assert Restraint.load(tmp_path / "s.yaml").units == {0: [2], 1: [0], 2: [1]}
    code, out = run_cli("--diff", write_attribution(tmp_path / "a.safetensors"), "--dimension", "multi_turn",
                        "--method", "attribution", "--top-k", 2, "--factor", 0, "--out", tmp_path / "a.yaml")
    assert code == 0 and Restraint.load(tmp_path / "a.yaml").source["method"] == "attribution"
    for args, message in (
        (("--method", "frequency-all", "--top-k", 3, "--factor", 0), "--method frequency-all reads tokens=all ones"),
        (("--method", "attribution", "--top-k", 3, "--factor", 0), "is a diff folder (from `rolemrc probe diff`); "
                                                                   "expected an attribution file"),
        (("--method", "standardized", "--top-k", 3, "--factor", 0, "--layers", "3-4"), "out of range"),
        (("--top-k", 3), "select needs --method and --factor named (--method: frequency | frequency-all | standardized "
                         "| attribution; --factor: 0 ablates, the paper's is 0.999999), or --calibration FOLDER"),
        (("--method", "standardized", "--top-k", 3), "select needs --factor named"),
        (("--method", "standardized", "--factor", 0), "choose exactly one of --top-k/--per-layer/--share/--fdr (given: none)"),
        (("--method", "standardized", "--factor", 0, "--top-k", 3, "--share", 0.5),
         "choose exactly one of --top-k/--per-layer/--share/--fdr (given: --top-k, --share)"),
        (("--method", "standardized", "--factor", 0, "--share", 1.5), "--share must be in (0, 1], got 1.5"),
        (("--method", "standardized", "--factor", 0, "--per-layer", 0), "--per-layer must be a whole number >= 1, got 0"),
        (("--calibration", tmp_path / "none", "--method", "standardized"), "--calibration supplies the method, budget "
                                                                           "and factor: drop --method"),
        (("--calibration", tmp_path / "none"), "none: no such file or folder"),
    ):
        code, out = run_cli("--diff", diff, "--dimension", "multi_turn", *args, "--out", tmp_path / "x.yaml")
        assert code == 2 and out.startswith("error: ") and len(out.strip().splitlines()) == 1 and message in out, out
    code, out = run_cli("--diff", diff, "--dimension", "multi_turn", "--method", "nope", "--out", tmp_path / "x.yaml")
    assert code == 2 and "Invalid value for '--method'" in out and "'nope' is not one of 'frequency'," in out, out
    code, out = run_cli("--help")
    assert code == 0 and all(name in out for name in SELECTORS.names()) and "--per-layer" in out and "--share" in out
    assert all(help.endswith("(exactly one of --top-k/--per-layer/--share/--fdr)") for help in BUDGET_HELP.values())


def test_an_unknown_method_fails_before_torch_loads(tmp_path):
    script = f"""
import sys
from typer.testing import CliRunner
import rolemrc.cli
res = CliRunner().invoke(rolemrc.cli.app, ["intervene", "select", "--diff", {str(tmp_path)!r}, "--dimension", "x",
                                           "--method", "nope", "--top-k", "3", "--out", {str(tmp_path / "s.yaml")!r}])
print(res.exit_code, "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["2", "False"]


def test_sweep_plans_cells_with_its_method(tmp_path):
    from rolemrc.sweep.plan import SweepConfig, plan

    diff = write_diff(tmp_path / "d")
    common = {"model": "m", "diff": str(diff), "data": "t.jsonl", "out": str(tmp_path / "s"), "dimensions": ["multi_turn"],
              "factors": [0.5], "top_k": [2], "controls": 1}
    with pytest.raises(RolemrcError, match="unknown selector 'nope'"):
        SweepConfig(**common, method="nope")
    for method, units in (("frequency", {0: [0], 1: [2]}), ("standardized", {0: [2], 2: [1]})):
        cells = plan(SweepConfig(**common, method=method), 4, {})
        selected = [c for c in cells if c.kind == "selected"]
        assert len(selected) == 1 and selected[0].restraint.units == units
        assert selected[0].restraint.source["method"] == method


@pytest.fixture
def mean_shift():
    """A selector added the documented way, one `@selector` entry, removed afterwards: the change in mean activation."""
    from rolemrc.probe.selectors import View, selector

    @selector("mean-shift", reads="diff", calibrated_on="all", label="Δ mean activation (B − A)", plots="mean activation",
              description="mean activation change, unscaled", ranks="|mean_b - mean_a|, no q")
    def view(result, dimension):
        return View(result.mean_b[dimension] - result.mean_a[dimension], None, "no test")

    yield "mean-shift"
    SELECTORS.unregister("mean-shift")


def test_one_selector_entry_reaches_every_consumer(tmp_path, mean_shift):
    """select (library and CLI), the sweep's plan, the explorer's data, the diff's stability and the calibration's
    defaults and inputs all read the one table: a new entry is in each without touching them."""
    from rolemrc.organism.calibration_config import CalibrationConfig
    from rolemrc.organism.detection import detect
    from rolemrc.probe.diff import load_diff
    from rolemrc.probe.explorer import explorer_data
    from rolemrc.sweep.plan import SweepConfig, plan

    diff = write_diff(tmp_path / "d")
    # EFFECT is mean_b - mean_a here: its three largest |values| are 4.0 (2, 1), 3.0 (0, 2), -2.5 (1, 0)
    assert select(diff, "multi_turn", method=mean_shift, factor=0.0, top_k=3).units == {0: [2], 1: [0], 2: [1]}
    code, out = run_cli("--diff", diff, "--dimension", "multi_turn", "--method", mean_shift, "--top-k", "3",
                        "--factor", "0", "--out", tmp_path / "s.yaml")
    assert code == 0, out
    assert Restraint.load(tmp_path / "s.yaml").source["method"] == mean_shift
    with pytest.raises(RolemrcError, match="has no q-values here .no test."):
        select(diff, "multi_turn", method=mean_shift, factor=0.0, fdr=0.05)
    cells = plan(SweepConfig(model="m", diff=str(diff), data="t.jsonl", out=str(tmp_path / "s"), dimensions=["multi_turn"],
                             factors=[0.5], top_k=[1], controls=1, method=mean_shift), 4, {})
    assert [c.restraint.units for c in cells if c.kind == "selected"] == [{2: [1]}]
    data = explorer_data(load_diff(diff))
    assert data["scores"][mean_shift] == "Δ mean activation (B − A)" and data["scatter"][mean_shift] == "mean activation"
    page = data["dimensions"]["multi_turn"]["selectors"][mean_shift]
    assert page["tested"] is False and page["ranked"]["score"][:3] == [4.0, 3.0, -2.5]
    assert mean_shift in CalibrationConfig(out=str(tmp_path / "c")).selectors
    found = detect({"all": str(diff)}, "multi_turn", {2: [1]}, [mean_shift])[mean_shift]
    assert found["auroc"] == 1.0
