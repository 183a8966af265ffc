"""Random-unit controls matched on activation magnitude (issue 51): per layer as many units as the cell, each from
its unit's decile of mean |activation| in that layer, never the cell's own units, the same draws for the same seed."""

from collections import Counter

import pytest
import torch
from fixtures import write_diff_file

from rolemrc.intervene.spec import Restraint, RestraintError
from rolemrc.sweep.controls import BINS, buckets, controls_record, draw_controls, unit_magnitudes
from rolemrc.sweep.plan import Cell

WIDTH = 200


def cell(units: dict[int, list[int]]) -> Restraint:
    return Restraint(name="cell", hook="mlp.act", units=units, factor=0.0, source={})


def magnitudes(layers: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.rand(layers, WIDTH, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) ** 3


def deciles(magnitude: torch.Tensor, units: dict[int, list[int]]) -> dict[int, Counter]:
    bucket = buckets(magnitude, BINS)
    return {layer: Counter(bucket[layer, chosen].tolist()) for layer, chosen in units.items()}


def test_each_control_unit_comes_from_its_units_layer_and_decile():
    magnitude = magnitudes()
    strongest = magnitude[2].argsort(descending=True)
    chosen = cell({0: [1, 5, 7, 40, 41, 150], 2: strongest[:8].tolist()})   # layer 2: 8 of the top decile's 20
    controls = draw_controls(chosen, WIDTH, 12, seed=3, magnitude=magnitude, how="test magnitudes")
    assert len(controls) == 12 and len({tuple(map(tuple, c.units.values())) for c in controls}) == 12
    for control in controls:
        assert {k: len(v) for k, v in control.units.items()} == {k: len(v) for k, v in chosen.units.items()}
        assert all(not set(control.units[layer]) & set(units) for layer, units in chosen.units.items())
        assert deciles(magnitude, control.units) == deciles(magnitude, chosen.units)
        assert control.source | {"draw": 0} == {"control_of": "cell", "draw": 0, "seed": 3, "bins": BINS,
                                                "matched_on": "test magnitudes", "unmatched": 0}
    again = draw_controls(chosen, WIDTH, 12, seed=3, magnitude=magnitude, how="test magnitudes")
    assert [c.units for c in again] == [c.units for c in controls]
    assert draw_controls(chosen, WIDTH, 12, seed=4, magnitude=magnitude)[0].units != controls[0].units


def test_a_decile_too_small_gives_what_it_has_and_counts_the_rest():
    magnitude = magnitudes(1)
    top = magnitude[0].argsort(descending=True)[:25].tolist()   # 25 units, 20 of them the top decile
    control = draw_controls(cell({0: top}), WIDTH, 1, magnitude=magnitude)[0]
    assert len(control.units[0]) == 25 and not set(control.units[0]) & set(top)
    assert control.source["unmatched"] == 20   # the top decile has no unit left; decile 8 has 15 left for its 5
    assert deciles(magnitude, control.units)[0][8] >= 5


def test_without_magnitudes_controls_are_uniform_per_layer():
    chosen = cell({1: list(range(0, WIDTH, 2))})   # half the layer
    control = draw_controls(chosen, WIDTH, 2)[0]
    assert control.units[1] == list(range(1, WIDTH, 2))   # the only units left
    assert (control.source["bins"], control.source["matched_on"], control.source["unmatched"]) == (1, "uniform", 0)
    with pytest.raises(RestraintError, match="too few remain"):
        draw_controls(cell({0: list(range(WIDTH // 2 + 1))}), WIDTH, 1)


def test_magnitudes_come_from_the_diffs_moments(tmp_path):
    delta = torch.linspace(-1, 1, 2 * 16).reshape(2, 16)
    write_diff_file(tmp_path / "diff", delta, torch.full_like(delta, 0.5))
    magnitude, how = unit_magnitudes(tmp_path / "diff", "multi_turn")
    assert torch.equal(magnitude, delta.double().abs()) and "mean_b" in how
    none, why = unit_magnitudes(tmp_path / "diff", "role_style")
    assert none is None and why.startswith("uniform:")
    chosen = cell({0: [0, 1]})
    cells = [Cell("s", "selected", {"dimension": "multi_turn"}, chosen)] + [
        Cell(f"c{k}", "control", {"dimension": "multi_turn"}, c, draw=k)
        for k, c in enumerate(draw_controls(chosen, 16, 3, magnitude=magnitude, how=how))]
    record = controls_record(cells)
    assert (record["per_cell"], record["bins"], record["matched_on"]) == (3, BINS, {"multi_turn": how})
