"""The restraint frontier (`rolemrc sweep frontier`): every restraint kind on one SFT -> DPO pair, on the same cases,
against controls of its own kind, in one currency of size.

Families (one curve each), per point a restraint and `controls` of the same kind and size:
- `scale xF` and `patch`: the selector's units (`--method`) at each per-layer budget, scaled by F, or set to their mean
  under the SFT model; controls: random units matched on activation magnitude (`sweep.controls`);
- `revert units a=A`: the same units' weights moved toward the SFT model by A; controls: random units, the same A;
- `revert layers a=A`: the blocks of the `top_layers` layers where the difference of means is longest (the layers
  `direction` takes) moved toward the SFT model by A; controls: as many random other layers, the same A;
- `direction`: the difference of means projected out of the `top_layers` layers where it is longest; controls: random
  unit directions in the same layers;
- `revert model`: every weight moved toward the SFT model by alpha (Lin et al.'s interpolation): no control, it is the
  comparator a unit method has to beat;
- given the units that carry the change (`known_units`: a units organism's S), `patch S` and `revert S` restrain
  exactly them: the ceiling a selector's units are measured against.

Each point is measured once, teacher-forced (`eval.divergence`): restoration, the share of the DPO model's KL to the
SFT model it undoes on the dimension's cases (1 − Σc/Σd); size, its mean KL from the DPO model per token of the
neutral texts; a revert's share of the DPO - SFT weight change it reverts (the bake's `size.reverted_share`); and,
given held-out preference pairs, the share of DPO's implicit-reward margin it keeps. CIs are
percentile bootstraps over cases (texts, pairs). At matched size, families are compared by interpolating each curve's
per-case restoration in log size and bootstrapping the paired difference over cases.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rolemrc.core.errors import InputError
from rolemrc.intervene.spec import Restraint

UNIT_KINDS = ("scale", "patch", "revert")   # families that restrain the selector's units
FAMILY_KINDS = ("scale", "patch", "revert-units", "revert-layers", "direction", "revert-model")
ROUNDS = 2000
MATCH_POINTS = 5   # sizes (log-spaced over the families' common range) where families are compared


@dataclass
class FrontierConfig:
    """One pair, one dimension, every kind."""

    model: str                      # the DPO model
    base: str                       # the SFT model: KL reference, revert reference, patch means' model
    diff: str                       # a diff of base (A) vs model (B) with moments: units, means, directions
    data: str                       # test cases; restoration is read on those of `dimension`
    dimension: str
    out: str
    neutral: str | None = None      # plain texts, one per line (default: the other cases' distinct references)
    pairs: str | None = None        # held-out preference pairs: the DPO margin each point keeps
    method: str = "standardized"    # the unit selector (its input: `diff`, or `attribution` for that selector)
    attribution: str | None = None
    families: list[str] = field(default_factory=lambda: list(FAMILY_KINDS))
    per_layer: list[int] = field(default_factory=lambda: [4, 16, 64])
    factors: list[float] = field(default_factory=lambda: [0.0])
    unit_alphas: list[float] = field(default_factory=lambda: [1.0])   # unit and layer reverts
    model_alphas: list[float] = field(default_factory=lambda: [0.05, 0.1, 0.2, 0.4, 0.7, 1.0])
    top_layers: list[int] = field(default_factory=lambda: [1, 2, 4])   # direction and layer reverts
    controls: int = 10
    known_units: dict[int, list[int]] | None = None   # the units that carry the change (a units organism's S)
    seed: int = 0
    limit: int | None = None
    max_new_tokens: int = 64        # the SFT model's greedy continuation of each case
    batch_size: int = 8
    dtype: str = "auto"
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.known_units:   # JSON keeps layers as strings (organism.json)
            self.known_units = {int(layer): [int(u) for u in units] for layer, units in self.known_units.items()}
        unknown = sorted(set(self.families) - set(FAMILY_KINDS))
        if unknown or not self.families:
            raise InputError(f"--families: some of {', '.join(FAMILY_KINDS)}, not {unknown or 'none'}")
        if self.controls < 10:
            raise InputError(f"--controls: at least 10 per point (a band of fewer says little), got {self.controls}")
        for name, values in (("--unit-alphas", self.unit_alphas), ("--model-alphas", self.model_alphas)):
            if not values or not all(0 < a <= 1 for a in values):
                raise InputError(f"{name}: values in (0, 1], got {values}")
        if any(k < 1 for k in [*self.per_layer, *self.top_layers]) or not self.per_layer or not self.top_layers:
            raise InputError("--per-layer and --top-layers: whole numbers >= 1")
        if self.method == "attribution" and not self.attribution:
            raise InputError("--method attribution reads --attribution, an attribution file of the pair")

    def check_inputs(self) -> None:
        """Every input readable and of its kind, before any model loads: the two models, the diff (with moments of
        the dimension), the cases, and the pairs, neutral texts and attribution where given."""
        from rolemrc.core.modeling import resolve_model
        from rolemrc.core.records import read_records
        from rolemrc.intervene.kinds import load_means
        from rolemrc.probe.attribution import load_attribution, read_pairs
        from rolemrc.sweep.plan import neutral_texts as read_lines

        for model in (self.model, self.base):
            resolve_model(model)
        diff, origin = load_means(self.diff, self.dimension)
        layers, width = diff.mean_a[self.dimension].shape
        outside = {layer: [u for u in units if not 0 <= u < width] for layer, units in (self.known_units or {}).items()
                   if not 0 <= layer < layers or any(not 0 <= u < width for u in units)}
        if outside:
            raise InputError(f"--known-units: layers or units outside the diff's {layers} x {width} ({origin}): "
                             f"{dict(list(outside.items())[:3])}")
        read_records(self.data, "test")
        if self.pairs:
            read_pairs(self.pairs)
        if self.neutral:
            read_lines(self.neutral)
        if self.attribution:
            load_attribution(self.attribution)


@dataclass
class Point:
    """One restraint of a family and its controls."""

    family: str
    kind: str
    setting: dict[str, float]
    restraint: Restraint
    controls: list[Restraint]


def unit_points(config: FrontierConfig, width: int) -> list[Point]:
    """The families built on the selector's units: scale, patch and unit revert at each per-layer budget."""
    from rolemrc.intervene.kinds import as_patch, as_revert
    from rolemrc.intervene.select import select, warnings_once
    from rolemrc.sweep.controls import draw_controls, unit_magnitudes

    source = config.attribution if config.method == "attribution" else config.diff
    magnitude, how = unit_magnitudes(config.diff, config.dimension)
    reference = base_reference(config)
    points = []
    with warnings_once():
        for k in config.per_layer:
            if k >= width:
                continue
            units = select(source, config.dimension, method=config.method, per_layer=k, factor=0.0,
                           name=f"{config.method}-{k}pl")
            drawn = draw_controls(units, width, config.controls, seed=config.seed, magnitude=magnitude, how=how)
            if "scale" in config.families:
                for f in config.factors:
                    points.append(Point(f"scale x{f:g}", "scale", {"per_layer": k, "factor": f},
                                        scaled(units, f), [scaled(c, f) for c in drawn]))
            if "patch" in config.families:
                points.append(Point("patch", "patch", {"per_layer": k}, as_patch(units, config.diff, config.dimension),
                                    [as_patch(c, config.diff, config.dimension) for c in drawn]))
            if "revert-units" in config.families:
                for a in config.unit_alphas:
                    points.append(Point(f"revert units a={a:g}", "revert", {"per_layer": k, "alpha": a},
                                        as_revert(units, a, reference), [as_revert(c, a, reference) for c in drawn]))
    return points


def scaled(r: Restraint, factor: float) -> Restraint:
    return dataclasses.replace(r, factor=factor)


def base_reference(config: FrontierConfig) -> dict[str, str]:
    """The SFT model as a unit revert's reference: its name and fingerprint."""
    from rolemrc.core.modeling import dir_fingerprint

    return {"name": config.base, "fingerprint": dir_fingerprint(config.base)}


def direction_points(config: FrontierConfig) -> list[Point]:
    """The difference-of-means direction in the `top_layers` longest layers; controls: random unit directions there."""
    from rolemrc.intervene.kinds import direction_restraint
    from rolemrc.sweep.controls import random_directions

    points = []
    for n in config.top_layers:
        r = direction_restraint(config.diff, config.dimension, top_layers=n, name=f"direction-{n}")
        if points and r.sites == points[-1].restraint.sites:   # fewer layers differ than asked
            continue
        points.append(Point("direction", "direction", {"top_layers": len(r.sites)}, r,
                            random_directions(r, config.controls, config.seed)))
    return points


def layer_points(config: FrontierConfig, layers: int) -> list[Point]:
    """The blocks of the `top_layers` layers where the difference of means is longest (those `direction` takes)
    reverted toward the SFT model at each unit alpha; controls: as many of the model's `layers` other layers, the same
    alpha. A top set of more than half the layers (no other set as large) is left out."""
    from rolemrc.intervene.kinds import direction_restraint, revert_restraint

    points, seen = [], []
    for n in config.top_layers:
        top = direction_restraint(config.diff, config.dimension, top_layers=n).sites
        if top in seen or 2 * len(top) > layers:   # fewer layers differ than asked, or no others to draw
            continue
        seen.append(top)
        drawn = layer_draws(top, layers, config.controls, config.seed)
        for a in config.unit_alphas:
            name = f"revert-layers-{len(top)}-a{a:g}"
            points.append(Point(f"revert layers a={a:g}", "revert", {"top_layers": len(top), "alpha": a},
                                revert_restraint(config.base, a, "layers", layers=spelled(top), name=name),
                                [revert_restraint(config.base, a, "layers", layers=spelled(c), name=f"{name}-control{j}")
                                 for j, c in enumerate(drawn)]))
    return points


def spelled(layers: list[int]) -> str:
    return ",".join(map(str, layers))


def layer_draws(top: list[int], layers: int, n: int, seed: int) -> list[list[int]]:
    """`n` sets of as many layers as `top` from the model's other layers, seeded: distinct while there are that many
    such sets, else each of them in turn (in a random order)."""
    import itertools

    import torch

    others = torch.tensor([layer for layer in range(layers) if layer not in top])
    gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(f"{seed}:layers:{top}".encode()).digest()[:8],
                                                       "little"))
    if math.comb(len(others), len(top)) <= n:
        sets = [list(c) for c in itertools.combinations(others.tolist(), len(top))]
        order = torch.randperm(len(sets), generator=gen).tolist()
        return [sets[order[j % len(sets)]] for j in range(n)]
    drawn: dict[tuple[int, ...], None] = {}
    while len(drawn) < n:
        drawn[tuple(sorted(others[torch.randperm(len(others), generator=gen)[:len(top)]].tolist()))] = None
    return [list(c) for c in drawn]


def model_points(config: FrontierConfig) -> list[Point]:
    """Global weight interpolation toward the SFT model (no controls)."""
    from rolemrc.intervene.kinds import revert_restraint

    return [Point("revert model", "revert", {"alpha": a}, revert_restraint(config.base, a, "model"), [])
            for a in config.model_alphas]


def ceiling_points(config: FrontierConfig, width: int) -> list[Point]:
    """`patch S` and `revert S` (alpha 1) on the known units S, each against random units of the same count."""
    from rolemrc.intervene.kinds import as_patch, as_revert
    from rolemrc.sweep.controls import draw_controls, unit_magnitudes

    if not config.known_units:
        return []
    known = Restraint(name="S", hook="mlp.act", factor=0.0, units=config.known_units, source={"units": "known"})
    magnitude, how = unit_magnitudes(config.diff, config.dimension)
    drawn = draw_controls(known, width, config.controls, seed=config.seed, magnitude=magnitude, how=how)
    reference = base_reference(config)
    setting = {"per_layer": max(len(u) for u in known.units.values())}
    return [Point("patch S", "patch", setting, as_patch(known, config.diff, config.dimension),
                  [as_patch(c, config.diff, config.dimension) for c in drawn]),
            Point("revert S", "revert", {**setting, "alpha": 1.0}, as_revert(known, 1.0, reference),
                  [as_revert(c, 1.0, reference) for c in drawn])]


def frontier_points(config: FrontierConfig, width: int, layers: int) -> list[Point]:
    points = unit_points(config, width) + ceiling_points(config, width)
    if "revert-layers" in config.families:
        points += layer_points(config, layers)
    if "direction" in config.families:
        points += direction_points(config)
    if "revert-model" in config.families:
        points += model_points(config)
    return points


def neutral_texts(config: FrontierConfig, records: list[dict]) -> list[str]:
    """The neutral texts: the file's lines, or the distinct references of the cases outside the dimension."""
    from rolemrc.core.taxonomy import dimensions_for_task
    from rolemrc.sweep.plan import neutral_texts as read_lines

    if config.neutral:
        return read_lines(config.neutral)
    texts = sorted({r["reference"] for r in records if r.get("reference")
                    and config.dimension not in dimensions_for_task(r.get("task"))})
    if len(texts) < 2:
        raise InputError(f"{config.data}: fewer than 2 references outside {config.dimension}; give --neutral")
    return texts


def measure(config: FrontierConfig, points: list[Point], *, progress: bool = True) -> dict[str, Any]:
    """Every point's and control's per-case restoration terms, neutral KL to the DPO model and (points only) DPO margin
    on the pairs: one teacher-forced pass per batch for all of them (`eval.divergence.kl_grid`, `margin_grid`)."""
    from rolemrc.core.modeling import load_model
    from rolemrc.core.records import first_cases, read_records
    from rolemrc.core.taxonomy import dimensions_for_task
    from rolemrc.eval.divergence import continuations, kl_grid, margin_grid
    from rolemrc.eval.generate import GenerateConfig
    from rolemrc.probe.attribution import read_pairs

    records = first_cases(read_records(config.data, "test")[0], config.limit)
    cases = [r for r in records if config.dimension in dimensions_for_task(r.get("task"))]
    if len(cases) < 2:
        raise InputError(f"{config.data}: {len(cases)} case(s) of {config.dimension}; the frontier needs at least 2")
    neutral = neutral_texts(config, records)
    sft, tok = load_model(config.base, dtype=config.dtype, device=config.device)
    dpo, _ = load_model(config.model, dtype=config.dtype, device=config.device)
    texts = continuations(cases, "sft", sft=sft, tokenizer=tok,
                          config=GenerateConfig(model=config.base, max_new_tokens=config.max_new_tokens,
                                                batch_size=config.batch_size, progress=progress))
    cells = [None] + [r for p in points for r in (p.restraint, *p.controls)]
    result = kl_grid(sft, dpo, tok, cases, texts, cells, batch_size=config.batch_size, neutral=neutral, progress=progress)
    out = {"d": result.dpo.numpy(), "c": result.kl.numpy(), "neutral_kl": result.neutral_kl.numpy(),
           "reverted_share": reverted_shares(dpo, sft, cells), "cases": len(cases), "texts": len(neutral)}
    if config.pairs:
        pairs, _ = read_pairs(config.pairs)
        out["margin"] = margin_grid(sft, dpo, tok, pairs, [None] + [p.restraint for p in points],
                                    batch_size=config.batch_size, progress=progress).numpy()
    return out


def reverted_shares(dpo: Any, sft: Any, cells: list[Restraint | None]) -> np.ndarray:
    """Each cell's share of the DPO - SFT weight change it reverts, as its bake reports it (`size.reverted_share`);
    NaN for a cell that reverts nothing."""
    from rolemrc.intervene.bake import restraint_size, squared_change

    total = squared_change(dpo, sft)
    return np.array([restraint_size(dpo, r, sft, total=total).get("reverted_share", math.nan) if r else math.nan
                     for r in cells])


MEASURES = ("d", "c", "neutral_kl", "reverted_share")   # what a kept measured.npz must hold to be read again


def measured(config: FrontierConfig, points: list[Point], out: Path, *, progress: bool = True) -> dict[str, Any]:
    """`measure`, kept in OUT/measured.npz under the digest of every cell and of what they are measured on, so a
    rerun with the same points and inputs summarises again without measuring."""
    from rolemrc.core.io import file_fingerprint
    from rolemrc.core.modeling import dir_fingerprint, resolve_model

    inputs = [dir_fingerprint(resolve_model(config.model)), dir_fingerprint(resolve_model(config.base)),
              file_fingerprint(config.data), *(file_fingerprint(f) for f in (config.pairs, config.neutral) if f),
              config.dimension, config.limit, config.max_new_tokens, config.dtype]
    key = hashlib.sha256(json.dumps([[p.restraint.digest, *(c.digest for c in p.controls)] for p in points] + inputs,
                                    default=str).encode()).hexdigest()[:16]
    path = out / "measured.npz"
    if path.is_file():
        kept = np.load(path, allow_pickle=False)
        if str(kept["key"]) == key and set(MEASURES) <= set(kept.files):
            return {name: kept[name] if kept[name].ndim else kept[name].item() for name in kept.files if name != "key"}
    result = measure(config, points, progress=progress)
    np.savez(path, key=key, **result)
    return result


def weights(n: int, seed: int) -> np.ndarray:
    from rolemrc.core.stats import resample_counts

    return resample_counts(n, ROUNDS, seed).astype(np.float64)


def interval(point: float, samples: np.ndarray) -> dict[str, float]:
    from rolemrc.core.stats import percentile_ci

    lo, hi = percentile_ci(samples)
    return {"mean": float(point), "lo": lo, "hi": hi}


def summarise(config: FrontierConfig, points: list[Point], measured: dict[str, Any]) -> dict[str, Any]:
    """Per point: restoration and size with CIs, its controls' band and its excess over them, the margin kept; per
    matched size, each family's restoration and the best family's lead."""
    d, c, nkl, share = measured["d"], measured["c"], measured["neutral_kl"], measured["reverted_share"]
    w_cases, w_texts = weights(len(d), config.seed), weights(nkl.shape[1], config.seed + 1)
    boot = 1 - (c @ w_cases.T) / (d @ w_cases.T)          # [cells, rounds]
    restored = 1 - c.sum(1) / d.sum()                        # [cells]
    size = nkl.mean(1)
    size_boot = (nkl @ w_texts.T) / w_texts.sum(1)
    rows, at = [], 1
    for k, p in enumerate(points):
        ctrl = slice(at + 1, at + 1 + len(p.controls))
        row = {"family": p.family, "kind": p.kind, **p.setting, "name": p.restraint.name,
               "units": p.restraint.num_units, "layers": len(p.restraint.sites or p.restraint.layers) or None,
               "restoration": interval(restored[at], boot[at]), "size": interval(size[at], size_boot[at]),
               **({"reverted_share": float(share[at])} if p.kind == "revert" else {}), "digest": p.restraint.digest}
        if p.controls:
            mean_ctrl = boot[ctrl].mean(0)
            row["controls"] = {"n": len(p.controls), "distinct": len({c.digest for c in p.controls}),
                               "restoration": [float(x) for x in restored[ctrl]],
                               "size": [float(x) for x in size[ctrl]],
                               **({"reverted_share": [float(x) for x in share[ctrl]]} if p.kind == "revert" else {}),
                               "excess": interval(restored[at] - restored[ctrl].mean(), boot[at] - mean_ctrl)}
        if "margin" in measured:
            m = measured["margin"]
            w_pairs = weights(m.shape[1], config.seed + 2)
            kept = (m[k + 1] @ w_pairs.T) / (m[0] @ w_pairs.T)
            row["margin_kept"] = interval(m[k + 1].sum() / m[0].sum(), kept)
        rows.append(row)
        at += 1 + len(p.controls)
    summary = {"config": asdict(config), "cases": measured["cases"], "texts": measured["texts"], "points": rows,
               "dpo_kl_to_sft": float(d.mean())}
    if "margin" in measured:
        m = measured["margin"][0]
        summary["dpo_margin"] = interval(m.mean(), (m @ weights(len(m), config.seed + 2).T)
                                         / weights(len(m), config.seed + 2).sum(1))
    summary["matched"] = matched(points, rows, c, d, w_cases)
    summary["headline"] = headline(summary)
    return summary


def matched(points: list[Point], rows: list[dict], c: np.ndarray, d: np.ndarray, w: np.ndarray) -> list[dict]:
    """At log-spaced sizes over the families' ranges (families of 2+ points), the families whose range covers the
    size (2 or more): each one's restoration (its curve interpolated in log size, per case) with a CI, and the
    leader's lead over the runner-up, paired over cases."""
    cell = np.cumsum([0, *(1 + len(p.controls) for p in points)])[:-1] + 1   # each point's row of c
    curves = family_curves([p.family for p in points], [row["size"]["mean"] for row in rows])
    if len(curves) < 2:
        return []
    ranges = {f: (sizes[0], sizes[-1]) for f, (sizes, _) in curves.items()}
    out = []
    for x in np.linspace(min(lo for lo, _ in ranges.values()), max(hi for _, hi in ranges.values()), MATCH_POINTS * 2):
        covering = [f for f, (lo, hi) in ranges.items() if lo - 1e-9 <= x <= hi + 1e-9]
        if len(covering) < 2:
            continue
        per_case = {f: interpolated(*curves[f], x, c[cell]) for f in covering}   # interpolated KL per case
        value = {f: float(1 - v.sum() / d.sum()) for f, v in per_case.items()}
        boot = {f: 1 - (v @ w.T) / (d @ w.T) for f, v in per_case.items()}
        ranked = sorted(value, key=value.get, reverse=True)
        lead = interval(value[ranked[0]] - value[ranked[1]], boot[ranked[0]] - boot[ranked[1]])
        out.append({"size": float(math.exp(x)), "restoration": {f: interval(value[f], boot[f]) for f in ranked},
                    "leader": ranked[0], "runner_up": ranked[1], "lead": lead})
    return out


def family_curves(families: list[str], sizes: list[float]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per family of points at 2 or more distinct sizes, all positive: their log sizes, ascending, and their
    positions in the lists."""
    by_family: dict[str, list[tuple[float, int]]] = {}
    for k, (family, size) in enumerate(zip(families, sizes)):
        by_family.setdefault(family, []).append((size, k))
    return {f: (np.log([s for s, _ in sorted(v)]), np.array([k for _, k in sorted(v)])) for f, v in by_family.items()
            if len({s for s, _ in v}) >= 2 and all(s > 0 for s, _ in v)}


def interpolated(log_sizes: np.ndarray, positions: np.ndarray, x: float, values: np.ndarray) -> np.ndarray:
    """A curve's value at log size `x`: linear in log size between the points around it (`family_curves`' log sizes
    and positions into `values`, the first axis), extended from the end segments."""
    j = int(np.clip(np.searchsorted(log_sizes, x) - 1, 0, len(log_sizes) - 2))
    gap = log_sizes[j + 1] - log_sizes[j]
    t = 0.0 if gap == 0 else (x - log_sizes[j]) / gap
    return (1 - t) * values[positions[j]] + t * values[positions[j + 1]]


def headline(summary: dict[str, Any]) -> str:
    """Which family restores most at matched size, and whether its lead is clear of 0."""
    rows = summary["matched"]
    if not rows:
        return ("No two families overlap in size (neutral KL from the DPO model), so none is compared at matched size; "
                "see the figure.")
    leaders = {r["leader"] for r in rows}
    clear = [r for r in rows if r["lead"]["lo"] > 0]   # at each size, among the families that reach it
    parts = [f"at KL {r['size']:.3g}: {r['leader']} {r['restoration'][r['leader']]['mean']:.3f} vs {r['runner_up']} "
             f"{r['restoration'][r['runner_up']]['mean']:.3f} (lead {r['lead']['mean']:+.3f} [{r['lead']['lo']:+.3f}, "
             f"{r['lead']['hi']:+.3f}])" for r in (rows[0], rows[-1])]
    who = (f"{next(iter(leaders))} restores the most at every matched size" if len(leaders) == 1 else
           f"the leader changes with size ({', '.join(sorted(leaders))})")
    return (f"On {summary['config']['dimension']}, {who} (among the families that reach it); the leader's lead over "
            f"the runner-up excludes 0 at {len(clear)} of {len(rows)} sizes: {'; '.join(parts)}.")


def run_frontier(config: FrontierConfig, *, progress: bool = True) -> dict[str, Any]:
    """Build every family's points and controls, measure them, and write OUT/frontier.json, frontier.md and the
    figure (frontier.html/png)."""
    from rolemrc.core.hooks import num_layers, width
    from rolemrc.core.io import write_json
    from rolemrc.core.modeling import load_model
    from rolemrc.intervene.inputs import input_hook
    from rolemrc.sweep.plots import frontier_figure

    config.check_inputs()
    skeleton, _ = load_model(config.model, dtype=config.dtype, device="cpu")
    points = frontier_points(config, width(skeleton, input_hook(config.diff)), num_layers(skeleton))
    del skeleton
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "points.json", [{"family": p.family, "setting": p.setting, "restraint": p.restraint.to_dict(),
                                      "controls": [c.to_dict() for c in p.controls]} for p in points])
    summary = summarise(config, points, measured(config, points, out, progress=progress))
    summary["figures"] = frontier_figure(summary, out)
    write_json(out / "frontier.json", {"kind": "frontier", **summary})   # read by people and calibrate, not rolemrc
    (out / "frontier.md").write_text(frontier_markdown(summary))
    return summary


def frontier_markdown(summary: dict[str, Any]) -> str:
    def ci(x: dict | None) -> str:
        return "–" if not x else f"{x['mean']:.3f} [{x['lo']:.3f}, {x['hi']:.3f}]"

    lines = ["# Restraint frontier", "", summary["headline"], "",
             f"{summary['cases']} cases of {summary['config']['dimension']}, {summary['texts']} neutral texts; the DPO "
             f"model's mean KL to the SFT model per token there: {summary['dpo_kl_to_sft']:.4g}.", "",
             "| family | setting | restoration | size (neutral KL from DPO) | share of DPO − SFT reverted | controls "
             "(min-max) | excess over controls | DPO margin kept |", "|---|---|---|---|---|---|---|---|"]
    for r in summary["points"]:
        setting = ", ".join(f"{k} {r[k]:g}" for k in ("per_layer", "factor", "alpha", "top_layers") if k in r)
        band = "–"
        if "controls" in r:
            c = r["controls"]
            band = f"{min(c['restoration']):.3f} to {max(c['restoration']):.3f}" + (
                f" ({c['distinct']} distinct of {c['n']}: no other units or layers to draw)" if c["distinct"] < c["n"]
                else "")
        share = f"{r['reverted_share']:.3g}" if "reverted_share" in r else "–"
        lines.append(f"| {r['family']} | {setting} | {ci(r['restoration'])} | {r['size']['mean']:.3g} | {share} | {band} | "
                     f"{ci(r.get('controls', {}).get('excess'))} | {ci(r.get('margin_kept'))} |")
    if summary["matched"]:
        families = list(dict.fromkeys(f for r in summary["matched"] for f in r["restoration"]))
        lines += ["", "## At matched size", "", "| neutral KL | " + " | ".join(families) + " | leader's lead |",
                  "|---" * (2 + len(families)) + "|"]
        lines += [f"| {r['size']:.3g} | " + " | ".join(ci(r["restoration"].get(f)) for f in families)
                  + f" | {r['leader']} over {r['runner_up']}: {ci(r['lead'])} |" for r in summary["matched"]]
    return "\n".join(lines) + "\n"

