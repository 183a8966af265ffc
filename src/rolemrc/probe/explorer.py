"""`rolemrc probe explore --diff DIFF_DIR [--attribution FILE] --out explorer.html`: one self-contained interactive
Plotly page.

Pick a dimension and a selector (`intervene select --method`: each of `probe.selectors` that reads the diff, and
those reading an attribution given an attribution file); see the layer-by-layer shift in the selector's score; click
a layer to see its units (A vs B, the score, FDR-significant units highlighted); click a unit to see the prompts that
activate it most under A and under B (from the probes' top cases, `probe collect --top-cases`); preview which units
`intervene select --method X` picks for given layers, direction and top-k or q < fdr. Per selector the page embeds
units in `ranking.rank_units` order of its scores and only filters them, so the preview is `select`'s choice: exactly
for top-k <= max_units, and for q < fdr where at most max_units per layer and sign qualify (else the page says how
many qualify).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from rolemrc.probe.attribution import Attribution, load_attribution
from rolemrc.probe.diff import DiffResult, load_diff
from rolemrc.probe.errors import ProbeError
from rolemrc.probe.ranking import first_per_group, moved, rank_units
from rolemrc.probe.selectors import readers, table
from rolemrc.probe.topcases import TopCases

TEMPLATE = Path(__file__).with_name("templates") / "explorer.html"
PROMPT_DIGITS = 4  # significant digits of the top prompts' activations
DIGITS = 6  # significant digits of the values in the page: a tiny q keeps its digits, never shows as 0


def significant(values: torch.Tensor, digits: int = DIGITS) -> list:
    """`values` as (nested) lists, rounded to `digits` significant digits; 0, NaN, infinities and values too small to
    scale (subnormal) are kept as they are."""
    x = values.double()
    scale = torch.pow(10.0, digits - 1 - torch.floor(torch.log10(x.abs())))
    rounded = torch.round(x * scale) / scale
    return torch.where(torch.isfinite(rounded) & (rounded != 0), rounded, x).tolist()


@dataclass(frozen=True)
class Ranked:
    """One selector's view of a dimension: signed scores, q (NaN without a test) and the A and B values the page
    plots against each other."""

    score: torch.Tensor
    q: torch.Tensor
    tested: bool
    a: torch.Tensor
    b: torch.Tensor


def no_attribution() -> str:
    """What the page says where no attribution file was given."""
    names = readers("attribution")
    return (f"{' and '.join(names)} need{'s' if len(names) == 1 else ''} an attribution file: `rolemrc probe attribute`, "
            "then `probe explore --attribution FILE`") if names else ""


def selectors(result: DiffResult, attribution: Attribution | None, dimension: str) -> dict[str, Ranked]:
    """Each selector's scores of a dimension, as `intervene select --method NAME` reads them (`probe.selectors`): those
    reading a diff of this one's token policy, and those reading an attribution where the attribution file scores
    the dimension; plotted against the diff's A and B frequencies or mean activations, as the selector says."""
    d = dimension
    nan = torch.full_like(result.delta[d], torch.nan, dtype=torch.float64)
    out = {}
    for entry in table():
        if entry.reads_diff_of(result.meta["tokens"]):
            view = entry.view(result, d)
        elif entry.reads == "attribution" and attribution is not None and d in attribution.scores:
            view = entry.view(attribution, d)
        else:
            continue
        a, b = (result.freq_a, result.freq_b) if entry.plots == "frequency" else (result.mean_a, result.mean_b)
        out[entry.name] = Ranked(view.score, nan if view.q is None else view.q, view.q is not None, a[d], b[d])
    return out


def ranked_data(r: Ranked, max_units: int, fdr: float) -> tuple[dict, torch.Tensor]:
    """The page's data of one selector and dimension: per-layer summaries, each layer's `max_units` highest scored
    units (the panels) and, in rank order, the units the preview picks from: per layer and sign (up, down), the
    `max_units` highest and the `max_units` highest with q < fdr; and the panels' flat unit indices."""
    score, q = r.score, r.q.double()
    layers, width = score.shape
    flat, sig = score.reshape(-1), (q < fdr).reshape(-1)
    layer_of = torch.arange(layers).repeat_interleave(width)
    order = rank_units(score, q)
    n = min(max_units, width)
    top = order[first_per_group(order, layer_of, n)]
    top = top[torch.sort(layer_of[top], stable=True).indices].reshape(layers, n)  # per layer, in rank order
    movers, group = moved(flat, "both"), layer_of * 2 + (flat > 0)
    embed = torch.zeros_like(sig)  # the preview's units: per layer and sign, the first max_units and those with q < fdr
    for pool in (movers, movers & sig):
        members = order[pool[order]]
        embed[members[first_per_group(members, group, max_units)]] = True
    ranked = order[embed[order]]
    data = {
        "tested": r.tested, "mean_abs": significant(score.abs().mean(1)), "signed_mean": significant(score.mean(1)),
        "significant": sig.reshape(layers, width).sum(1).tolist(),
        **{f"significant_{way}": (sig & moved(flat, way)).reshape(layers, width).sum(1).tolist() for way in ("up", "down")},
        "units": (top % width).tolist(), "a": significant(r.a.reshape(-1)[top]), "b": significant(r.b.reshape(-1)[top]),
        "score": significant(flat[top]), "q": significant(q.reshape(-1)[top]), "sig": sig[top].int().tolist(),
        "ranked": {"layer": (ranked // width).tolist(), "unit": (ranked % width).tolist(),
                   "score": significant(flat[ranked]), "q": significant(q.reshape(-1)[ranked]),
                   "sig": sig[ranked].int().tolist()},
    }
    return data, top.reshape(-1)


def top_prompts(tops: dict[str, TopCases], units: torch.Tensor) -> dict:
    """For the flat `units` the panels show (sorted): per side, each unit's top cases (`cases`, -1 where empty) and
    their activations (`values`, PROMPT_DIGITS significant digits), and the texts of the cases listed ([id,
    dimensions, text])."""
    out: dict = {"n": max((t.n for t in tops.values()), default=0), "units": units.tolist(), "sides": {}}
    for side, top in tops.items():
        cases = top.cases.reshape(-1, top.n)[units]
        listed = torch.unique(cases[cases >= 0]).tolist()
        out["sides"][side] = {"cases": cases.tolist(), "values": significant(top.values.reshape(-1, top.n)[units], PROMPT_DIGITS),
                              "texts": {c: [top.texts[c][key] for key in ("id", "dimensions", "text")] for c in listed}}
    return out


def explorer_data(result: DiffResult, max_units: int = 512, fdr: float = 0.05,
                  attribution: Attribution | None = None) -> dict:
    """The JSON the page runs on: per dimension and selector, `ranked_data`; the top prompts of the units shown."""
    dims, shown = {}, []
    for d in result.dimensions:
        per = {}
        for name, r in selectors(result, attribution, d).items():
            per[name], panel = ranked_data(r, max_units, fdr)
            shown.append(panel)
        dims[d] = {"cases_a": result.cases_a.get(d), "cases_b": result.cases_b.get(d), "selectors": per}
    width = int(result.meta["width"])
    units = torch.unique(torch.cat(shown)) if shown else torch.zeros(0, dtype=torch.long)
    return {"hook": result.hook, "a": result.meta.get("a", ""), "b": result.meta.get("b", ""), "fdr": fdr,
            "layers": int(result.meta["layers"]), "width": width, "max_units": max_units, "not_compared": result.empty,
            "scores": {x.name: x.label for x in table()}, "scatter": {x.name: x.plots for x in table()},
            "no_attribution": "" if attribution is not None else no_attribution(),
            "attribution_selectors": readers("attribution"),
            "prompts": top_prompts(result.top_cases, units), "dimensions": dims}


def check_attribution(result: DiffResult, attribution: Attribution, where: str) -> None:
    """Refuse an attribution file of another hook point or shape than the diff."""
    shape = (int(attribution.meta["layers"]), int(attribution.meta["width"]))
    if attribution.meta["hook"] != result.hook or shape != (int(result.meta["layers"]), int(result.meta["width"])):
        raise ProbeError(f"{where}: an attribution of {attribution.meta['hook']} {shape[0]} x {shape[1]}, but the diff "
                         f"is of {result.hook} {result.meta['layers']} x {result.meta['width']}: attribute the same "
                         "models at the same hook point")


def write_explorer(diff: str | os.PathLike | DiffResult, out: str | os.PathLike, *, max_units: int = 512,
                   fdr: float = 0.05, attribution: str | os.PathLike | Attribution | None = None) -> Path:
    """Write the explorer page for a diff (its folder or file, or a DiffResult), with the attribution selector given
    an attribution (a file from `probe attribute`, or an Attribution), to `out` (plotly.js inlined: works offline)."""
    from plotly.offline import get_plotlyjs

    result = diff if isinstance(diff, DiffResult) else load_diff(diff)
    if not result.dimensions:
        where = "the DiffResult" if isinstance(diff, DiffResult) else str(diff)
        raise ProbeError(f"{where}: the diff has no compared dimension (not compared: {result.empty})")
    if attribution is not None:
        where = "the Attribution" if isinstance(attribution, Attribution) else str(attribution)
        attribution = attribution if isinstance(attribution, Attribution) else load_attribution(attribution)
        check_attribution(result, attribution, where)
    data = json.dumps(explorer_data(result, max_units, fdr, attribution)).replace("</", "<\\/")
    page = TEMPLATE.read_text().replace("/*PLOTLYJS*/", get_plotlyjs()).replace("/*DATA*/null", data)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
