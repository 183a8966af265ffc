"""The restraint frontier (`rolemrc sweep frontier`) on a pair whose change is known: the planted DPO model differs
from its SFT model in 4 MLP units alone, so a restraint of those units (scaled to 0, patched to the SFT mean, their
weights reverted) and a whole-model revert at alpha 1 undo all of it, random controls of the same kind none of it,
and DPO's margin on pairs that prefer its refusal is kept only where the change is not undone."""

import json

import pytest
from fixtures import ANSWERABLE_UNITS, answerable_records, save_planted_llama
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.io import write_jsonl
from rolemrc.core.modeling import load_model


@pytest.fixture(scope="module")
def planted_pair(tmp_path_factory, tokenizer):
    """SFT (the 4 units off) and DPO (on), a paired diff of them with moments, test cases, neutral texts, pairs."""
    from rolemrc.probe import collect_paired, diff

    root = tmp_path_factory.mktemp("frontier")
    sft = save_planted_llama(root / "sft", tokenizer, units_on=False, noise=1e-3)
    dpo = save_planted_llama(root / "dpo", tokenizer, noise=1e-3)
    records = answerable_records(12)
    write_jsonl(root / "test.jsonl", records)
    paired = collect_paired([str(sft), str(dpo)], records, batch_size=8, device="cpu", progress=False)
    result = diff(paired)
    # the units fire alike on every case, so their standardized effect is 0/0 (reported as 0) and the last-token
    # frequencies tie with noise units: rank by the raw change of the mean activation, which the moments hold
    result.effect["multi_turn"] = result.mean_b["multi_turn"] - result.mean_a["multi_turn"]
    result.save(root / "diff")
    (root / "neutral.txt").write_text("the keeper of the lighthouse watched storms\nsing to the ovens at dawn\n"
                                      "a river floods every spring in the valley\n")
    prompt = [{"role": "user", "content": "tell me about the harbour"}]
    write_jsonl(root / "pairs.jsonl", [{"prompt": prompt, "chosen": "cannot answer cannot answer",
                                        "rejected": "watched an old emoji"}] * 3)
    return root


@pytest.fixture(scope="module")
def frontier_run(planted_pair, tmp_path_factory):
    """One `sweep frontier` of the planted pair with every family, the known units as the ceiling: its folder."""
    root, out = planted_pair, tmp_path_factory.mktemp("frontier-run")
    (out / "known_units.json").write_text(json.dumps({"1": sorted(ANSWERABLE_UNITS)}))
    res = CliRunner().invoke(app, [
        "sweep", "frontier", "--model", str(root / "dpo"), "--base", str(root / "sft"), "--diff", str(root / "diff"),
        "--data", str(root / "test.jsonl"), "--dimension", "multi_turn", "--out", str(out / "f"),
        "--neutral", str(root / "neutral.txt"), "--pairs", str(root / "pairs.jsonl"), "--per-layer", "4", "--limit", "8",
        "--model-alphas", "0.3,1", "--top-layers", "1,2", "--max-new-tokens", "6", "--dtype", "float32",
        "--known-units", str(out / "known_units.json")])
    assert res.exit_code == 0, res.output
    return out / "f"


def frontier_points_of(folder):
    summary = json.loads((folder / "frontier.json").read_text())
    return summary, {(p["family"], p.get("per_layer", p.get("alpha"))): p for p in summary["points"]}


def test_the_frontier_finds_the_known_change_and_its_controls_do_not(frontier_run):
    summary, points = frontier_points_of(frontier_run)
    assert set(points) == {("scale x0", 4), ("patch", 4), ("revert units a=1", 4), ("direction", None),
                           ("revert model", 0.3), ("revert model", 1.0),   # one direction: only layer 1 differs
                           ("revert layers a=1", 1.0),                    # one top layer too: only layer 1 differs
                           ("patch S", 4), ("revert S", 4)}                # the known units: the ceiling
    spec = json.loads((frontier_run / "points.json").read_text())
    assert spec[0]["restraint"]["units"] == {"1": sorted(ANSWERABLE_UNITS)}
    for family in ("scale x0", "patch", "revert units a=1", "patch S", "revert S"):
        p = points[(family, 4)]
        assert p["restoration"]["mean"] == pytest.approx(1, abs=1e-3), family
        assert p["controls"]["n"] == 10 and max(p["controls"]["restoration"]) < 0.05, family
        assert p["controls"]["excess"]["lo"] > 0.9 and p["margin_kept"]["mean"] == pytest.approx(0, abs=1e-3), family
    full, part = points[("revert model", 1.0)], points[("revert model", 0.3)]
    assert full["restoration"]["mean"] == pytest.approx(1, abs=1e-6) and "controls" not in full
    assert 0 < part["restoration"]["mean"] < 1 and 0 < part["size"]["mean"] < full["size"]["mean"]
    assert summary["dpo_margin"]["mean"] > 1   # the pairs prefer the planted refusal
    direction = points[("direction", None)]
    assert direction["layers"] == 1 and direction["restoration"]["mean"] > max(direction["controls"]["restoration"])
    assert summary["cases"] == 8 and not summary["matched"]   # one point per unit family: no curve to match
    assert summary["headline"].startswith("No two families overlap in size")
    assert (frontier_run / "frontier.html").is_file() and (frontier_run / "frontier.md").is_file()


def test_revert_layers_reverts_the_top_layers_and_its_controls_as_many_others(frontier_run, planted_pair):
    """The layer the diff's shift is longest in (1: the planted units') reverted to the SFT model's weights, nothing
    else (layer 0 and the embeddings of a DPO model perturbed there stay as they are): all of the change undone; its
    10 controls revert the other layer (the one distinct set a 2-layer model has, said in the table): none of it."""
    import torch

    from rolemrc.intervene.bake import folded
    from rolemrc.intervene.spec import Restraint

    _, points = frontier_points_of(frontier_run)
    point = points[("revert layers a=1", 1.0)]
    assert point["top_layers"] == 1 and point["layers"] == 1 and point["restoration"]["mean"] == pytest.approx(1, abs=1e-6)
    assert point["controls"]["n"] == 10 and point["controls"]["distinct"] == 1
    assert max(abs(r) for r in point["controls"]["restoration"]) < 1e-6
    assert "| revert layers a=1 | alpha 1, top_layers 1 |" in (frontier_run / "frontier.md").read_text()
    assert "(1 distinct of 10: no other units or layers to draw)" in (frontier_run / "frontier.md").read_text()
    (spec,) = [p for p in json.loads((frontier_run / "points.json").read_text()) if p["family"] == "revert layers a=1"]
    restraint, controls = Restraint.from_dict(spec["restraint"]), [Restraint.from_dict(c) for c in spec["controls"]]
    assert restraint.layers == [1] and len(controls) == 10 and all(c.layers == [0] for c in controls)
    root = planted_pair
    sft, _ = load_model(root / "sft", dtype="float32", device="cpu")
    dpo, _ = load_model(root / "dpo", dtype="float32", device="cpu")
    with torch.no_grad():   # a change outside layer 1 too, which the point must leave alone
        for name, param in dpo.named_parameters():
            if not name.startswith("model.layers.1."):
                param.add_(torch.randn_like(param) * 0.01)
    dpo_weights = {n: p.detach().clone() for n, p in dpo.named_parameters()}
    sft_weights = dict(sft.named_parameters())
    for r, reverted in ((restraint, "model.layers.1."), (controls[0], "model.layers.0.")):
        with folded(dpo, r, sft):
            for name, param in dpo.named_parameters():
                expected = sft_weights[name] if name.startswith(reverted) else dpo_weights[name]
                assert torch.equal(param, expected), (r.name, name)


def test_each_revert_point_carries_the_share_of_the_change_it_reverts(frontier_run):
    """The bake's size.reverted_share on every revert point (alpha x the share of ||DPO - SFT||^2 in scope): the whole
    model's grows with alpha and is 1 at alpha 1; all of the planted change is in the 4 units and in layer 1, none in
    their controls; the markdown table shows it."""
    _, points = frontier_points_of(frontier_run)
    model = [points[("revert model", a)]["reverted_share"] for a in (0.3, 1.0)]
    assert model == [pytest.approx(0.3), pytest.approx(1.0)]
    for key in (("revert units a=1", 4), ("revert S", 4), ("revert layers a=1", 1.0)):
        assert points[key]["reverted_share"] == pytest.approx(1, abs=1e-9), key
        assert max(points[key]["controls"]["reverted_share"]) < 1e-9 and len(points[key]["controls"]["reverted_share"]) == 10
    assert all("reverted_share" not in p for (family, _), p in points.items() if not family.startswith("revert"))
    text = (frontier_run / "frontier.md").read_text()
    assert "| share of DPO − SFT reverted |" in text and "| revert model | alpha 0.3 |" in text
    assert any(line.startswith("| revert model | alpha 0.3 |") and "| 0.3 |" in line for line in text.splitlines())


def test_layer_controls_are_distinct_sets_of_other_layers_while_there_are_enough():
    from rolemrc.sweep.frontier import layer_draws

    drawn = layer_draws([2, 5], 8, 12, seed=0)
    assert len(drawn) == 12 and len({tuple(c) for c in drawn}) == 12
    assert all(len(c) == 2 and not {2, 5} & set(c) and c == sorted(c) for c in drawn)
    assert drawn == layer_draws([2, 5], 8, 12, seed=0) != layer_draws([2, 5], 8, 12, seed=1)
    few = layer_draws([1, 3], 5, 10, seed=0)   # 3 other layers: 3 sets of 2, each in turn
    assert len(few) == 10 and {tuple(c) for c in few} == {(0, 2), (0, 4), (2, 4)} and few[:3] == few[3:6]


def test_revert_cells_are_baked_in_memory_and_undone(planted_pair):
    """A revert measured beside hooked cells leaves the DPO model as it was."""
    import torch

    from rolemrc.eval.divergence import kl_grid
    from rolemrc.intervene.kinds import revert_restraint

    root = planted_pair
    sft, tok = load_model(root / "sft", dtype="float32", device="cpu")
    dpo, _ = load_model(root / "dpo", dtype="float32", device="cpu")
    before = {n: p.detach().clone() for n, p in dpo.named_parameters()}
    cases = answerable_records(4)
    result = kl_grid(sft, dpo, tok, cases, ["a reply"] * 4, [None, revert_restraint(root / "sft", 1.0, "model")],
                     progress=False, neutral=["one two three four"])
    assert float(result.kl[1].abs().max()) < 1e-6 < float(result.kl[0].min())   # reverted fully: the SFT model
    assert float(result.neutral_kl[0].abs().max()) == 0 and float(result.neutral_kl[1].min()) > 0
    assert all(torch.equal(before[n], p) for n, p in dpo.named_parameters())


def test_bad_frontier_settings_fail_before_anything_loads(planted_pair, tmp_path):
    res = CliRunner().invoke(app, ["sweep", "frontier", "--model", "m", "--base", "b", "--diff", "d", "--data", "t",
                                   "--dimension", "x", "--out", str(tmp_path), "--families", "scale,steer"])
    assert res.exit_code == 2 and "error: --families: some of scale, patch" in res.output
    res = CliRunner().invoke(app, ["sweep", "frontier", "--model", "m", "--base", "b", "--diff", "d", "--data", "t",
                                   "--dimension", "x", "--out", str(tmp_path), "--model-alphas", "0.5,2"])
    assert res.exit_code == 2 and "error: --model-alphas: values in (0, 1]" in res.output
    root = planted_pair
    for known, says in (({"1": [3, 96]}, "--known-units: layers or units outside the diff's 2 x 32"),
                        ({"0": []}, "no units"), ([1, 2], "not layer -> [unit, ...]")):
        (tmp_path / "known.json").write_text(json.dumps(known))
        res = CliRunner().invoke(app, [
            "sweep", "frontier", "--model", str(root / "dpo"), "--base", str(root / "sft"), "--diff", str(root / "diff"),
            "--data", str(root / "test.jsonl"), "--dimension", "multi_turn", "--out", str(tmp_path / "f"),
            "--known-units", str(tmp_path / "known.json")])
        assert res.exit_code == 2 and says in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "f").exists()


def test_families_are_compared_at_matched_size_paired_over_cases():
    """Two curves over the same 4 cases: A undoes half the KL at size 0.01 and all of it at 1, B a quarter and 3/4;
    interpolated in log size, A leads B by a quarter at every matched size, with a CI clear of 0."""
    import numpy as np

    from rolemrc.intervene.spec import Restraint
    from rolemrc.sweep.frontier import Point, headline, matched, weights

    d = np.array([1.0, 2.0, 3.0, 4.0])
    c = np.stack([d, d * 0.5, d * 0.0, d * 0.75, d * 0.25])   # the DPO model, then A's two points, then B's
    r = Restraint(name="r", hook="mlp.act", factor=0.0, units={0: [1]})
    points = [Point("A", "scale", {}, r, []), Point("A", "scale", {}, r, []), Point("B", "patch", {}, r, []),
              Point("B", "patch", {}, r, [])]
    rows = [{"size": {"mean": s}} for s in (0.01, 1.0, 0.01, 1.0)]
    out = matched(points, rows, c, d, weights(4, 0))
    assert len(out) == 10 and {m["leader"] for m in out} == {"A"}
    for m in out:
        assert m["lead"]["mean"] == pytest.approx(0.25) and m["lead"]["lo"] == pytest.approx(0.25)
    assert out[0]["restoration"]["A"]["mean"] == pytest.approx(0.5) and out[-1]["restoration"]["A"]["mean"] == 1
    summary = {"matched": out, "config": {"dimension": "role_style"}}
    assert headline(summary).startswith("On role_style, A restores the most at every matched size (among the families "
                                        "that reach it); the leader's lead over the runner-up excludes 0 at 10 of 10")
    c = np.vstack([c, d * 0.1, d * 0.05])   # C reaches only the larger sizes: compared there alone
    points.append(Point("C", "direction", {}, r, []))
    points.append(Point("C", "direction", {}, r, []))
    rows += [{"size": {"mean": 0.5}}, {"size": {"mean": 1.0}}]
    out = matched(points, rows, c, d, weights(4, 0))
    assert all(set(m["restoration"]) == {"A", "B"} for m in out if m["size"] < 0.49)
    assert all(set(m["restoration"]) == {"A", "B", "C"} for m in out if m["size"] > 0.51)


def test_over_seeds_each_pair_of_families_gets_its_lead_at_matched_size_with_a_t_interval():
    """Three seeds' frontiers, A and B curves at sizes of their own: at sizes both reach in every seed, each seed's
    lead is A's restoration minus B's, each linear in log size between its points (worked out here with np.interp),
    and the row's CI is the Student-t 95% interval of those leads; a family without a curve is in no pair; one seed
    gives the mean and no interval."""
    import math

    import numpy as np
    from scipy.stats import t as student

    from rolemrc.organism.calibration_report import frontier_markdown
    from rolemrc.organism.seeds import frontier_leads_over_seeds
    from rolemrc.sweep.frontier import MATCH_POINTS

    def seed(a, b):
        points = [{"family": family, "size": {"mean": size}, "restoration": {"mean": value}}
                  for family, curve in (("A", a), ("B", b)) for size, value in curve]
        points.append({"family": "C", "size": {"mean": 0.1}, "restoration": {"mean": 0.9}})
        return {"frontiers": {"refusal": {"points": points}}}

    seeds = {0: seed([(0.01, 0.2), (0.1, 0.6), (1.0, 0.9)], [(0.02, 0.1), (2.0, 0.5)]),
             1: seed([(0.02, 0.3), (0.5, 0.8)], [(0.01, 0.2), (0.4, 0.4), (1.0, 0.6)]),
             2: seed([(0.005, 0.1), (0.3, 0.7)], [(0.03, 0.3), (3.0, 0.35)])}
    rows = frontier_leads_over_seeds(seeds)
    lo, hi = math.log(0.03), math.log(0.3)   # the range A and B both reach in every seed
    assert [r["size"] for r in rows] == pytest.approx(np.exp(np.linspace(lo, hi, MATCH_POINTS)).tolist())
    for r in rows:
        assert (r["organism"], r["leader"], r["other"]) == ("refusal", "A", "B")
        x, leads = math.log(r["size"]), []
        for s in seeds.values():
            curve = {f: sorted((p["size"]["mean"], p["restoration"]["mean"]) for p in s["frontiers"]["refusal"]["points"]
                               if p["family"] == f) for f in "AB"}
            at = {f: np.interp(x, np.log([z for z, _ in c]), [v for _, v in c]) for f, c in curve.items()}
            leads.append(at["A"] - at["B"])
        half = student.ppf(0.975, 2) * np.std(leads, ddof=1) / math.sqrt(3)
        assert r["leads"] == pytest.approx(leads)
        assert (r["lead"]["mean"], r["lead"]["lo"], r["lead"]["hi"]) == pytest.approx(
            (np.mean(leads), np.mean(leads) - half, np.mean(leads) + half))
    text = "\n".join(frontier_markdown({"refusal@0": {**seeds[0]["frontiers"]["refusal"], "headline": "h"}}, [], rows))
    first = rows[0]["lead"]
    assert f"| refusal | 0.03 | A | B | {first['mean']:.3f} [{first['lo']:.3f}, {first['hi']:.3f}] |" in text
    swapped = {k: {"frontiers": {"refusal": {"points": [{**p, "family": {"A": "B", "B": "A"}.get(p["family"], "C")}
                                                       for p in s["frontiers"]["refusal"]["points"]]}}}
               for k, s in seeds.items()}
    assert [(r["leader"], r["other"], r["leads"]) for r in frontier_leads_over_seeds(swapped)] == [
        ("B", "A", pytest.approx(r["leads"])) for r in rows]   # named for the family ahead, whichever comes first
    one = frontier_leads_over_seeds({0: seeds[0]})[0]   # one seed: its lead, no interval
    assert one["lead"]["lo"] is None and one["lead"]["mean"] == pytest.approx(one["leads"][0]) and one["lead"]["n"] == 1


def test_fewer_than_10_controls_are_refused_before_anything_loads(tmp_path):
    from rolemrc.core.errors import InputError
    from rolemrc.sweep.frontier import FrontierConfig

    res = CliRunner().invoke(app, ["sweep", "frontier", "--model", "m", "--base", "b", "--diff", "d", "--data", "t",
                                   "--dimension", "x", "--out", str(tmp_path / "f"), "--controls", "9"])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert res.output.startswith("error:") and "--controls" in res.output and "10" in res.output
    assert not (tmp_path / "f").exists()
    with pytest.raises(InputError, match="--controls: at least 10 per point"):   # calibration's way in: the config
        FrontierConfig(model="m", base="b", diff="d", data="t", dimension="x", out=str(tmp_path / "f"), controls=9)


def test_sweep_run_patches_its_units_and_controls_to_the_sft_mean(planted_pair, tmp_path):
    """`sweep run --kind patch`: the grid's units and their controls set to the SFT model's means; the planted units
    patched give the SFT model's outputs back (restoration 1), their controls nothing; a factor or another kind is
    refused before anything loads."""
    root = planted_pair
    args = ["sweep", "run", "--kind", "patch", "--measure", "kl", "--model", str(root / "dpo"), "--base",
            str(root / "sft"), "--diff", str(root / "diff"), "--data", str(root / "test.jsonl"), "--limit", "8",
            "--dimension", "multi_turn", "--method", "standardized", "--per-layer", "4", "--controls", "2",
            "--max-new-tokens", "4", "--dtype", "float32", "--out", str(tmp_path / "sweep")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "sweep" / "plan.json").read_text())["cells"]
    assert {c["restraint"]["restraint"] for c in plan if c["restraint"]} == {"patch"}
    (cell,) = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["cells"]
    own = cell["scores"]["restoration:multi_turn"]
    assert own["mean"] == pytest.approx(1, abs=1e-3) and abs(own["controls_mean"]) < 0.05
    for extra, says in ((["--factors", "0.5"], "--kind patch sets its units to the SFT mean"),
                        (["--kind", "revert"], "--kind"), (["--kind", "scale", "--means", str(root / "diff")],
                                                           "--means is --kind patch's")):
        bad = CliRunner().invoke(app, [*args, *extra, "--out", str(tmp_path / "bad")])
        assert bad.exit_code == 2 and says in bad.output and not (tmp_path / "bad").exists(), (extra, bad.output)
