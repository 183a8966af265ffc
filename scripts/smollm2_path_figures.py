"""docs/researcher-path.md and its pictures, from a run of scripts/smollm2_path.sh: every figure the page quotes is read
from the run's own files, so page and run stay in step.

    python scripts/smollm2_path_figures.py runs/smollm2-path

Pictures (docs/img/smollm2-*.png): the diff's layers x dimensions heatmap, the explorer on the attribution selector
(headless Chromium), the sweep's dose-response for the dimension DPO cost most, and the A/B chart.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from docs_pictures import ROOT, explorer_screenshot, save_png


def read(run: Path, name: str) -> dict:
    return json.loads((run / name).read_text())


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


# each quickstart command and the file it writes last, in order: a step's time is its file's mtime minus the one before
OUTPUTS = [("eval run (SFT)", "eval/sft/report.md"), ("eval run (DPO)", "eval/dpo/report.md"),
           ("eval compare", "cost/compare.md"), ("probe collect", "paired.safetensors"), ("probe diff", "diff/summary.json"),
           ("probe attribute", "attribution.safetensors"), ("probe explore", "explorer.html"),
           ("sweep run", "sweep/sweep.md"), ("intervene select", "restraint.yaml"),
           ("intervene check + bake", "runs/dpo-restrained/config.json"),
           ("intervene lora", "runs/dpo-restraint-lora/adapter_config.json"),
           ("serve, ab create, eval generate (the A/B traffic)", "ab-traffic.jsonl"), ("ab report", "ab/report.json")]


def step_times(run: Path) -> list[tuple[str, float]]:
    """(step, seconds) from the outputs' modification times, starting when quickstart.sh was written; up to the first
    step whose output is missing."""
    times, before = [], (run / "quickstart.sh").stat().st_mtime
    for step, output in OUTPUTS:
        if not (run / output).exists():
            break
        done = (run / output).stat().st_mtime
        times.append((step, done - before))
        before = done
    return times


def cost_section(run: Path) -> tuple[str, list[str]]:
    compare = read(run, "cost/compare.json")
    cost = compare["costliest"]
    rows = ["| dimension | SFT | DPO | change [95% CI, items resampled] | p (McNemar) | verdicts |", "|---|---|---|---|---|---|"]
    for dim, r in compare["verdicts"].items():
        rows.append(f"| {dim} | {pct(r['a_rate'])}% | {pct(r['b_rate'])}% | {100 * r['diff']:+.1f} "
                    f"[{100 * r['lo']:+.1f}, {100 * r['hi']:+.1f}] | {r['p']:.3g} | {r['n']} |")
    verdict = ("its CI excludes 0" if cost["excludes_zero"] else "its CI includes 0: on these cases DPO's cost is not "
               "measurable, and the rest of the path restrains a dimension with nothing to give back")
    lines = [f"`eval compare` names **{cost['dimension']}**: {100 * cost['diff']:+.1f} points "
             f"[{100 * cost['lo']:+.1f}, {100 * cost['hi']:+.1f}], McNemar p = {cost['p']:.3g}; {verdict}.", "", *rows]
    return cost["dimension"], lines


def diff_section(run: Path, img: Path, dimension: str) -> tuple[list[str], list[Path]]:
    summary = read(run, "diff/summary.json")
    rows = ["| dimension | cases | mean abs shift | units at q < 0.05 (McNemar) | peak layer |", "|---|---|---|---|---|"]
    for dim, d in summary["dimensions"].items():
        rows.append(f"| {dim} | {d['cases_a']} | {d['mean_abs_delta']:.4f} | {d['significant_units']} | {d['peak_layer']} |")
    heatmap = save_png((run / "diff" / "heatmap_layers_dimensions.png").read_bytes(), img / "smollm2-diff-heatmap.png")
    return [*rows, "", f"![SmolLM2 SFT -> DPO: mean shift per layer and dimension](img/{heatmap.name})"], [heatmap]


def attribution_section(run: Path, img: Path, dimension: str) -> tuple[list[str], list[Path]]:
    from rolemrc.probe.attribution import load_attribution

    scores = load_attribution(run / "attribution.safetensors").scores[dimension]   # [layers, width], mean per pair
    per_layer = scores.abs().sum(1).numpy()
    top = per_layer.argsort()[::-1][:3]
    share = per_layer[top].sum() / per_layer.sum()
    shot = explorer_screenshot(run, img, dimension, int(top[0]), selector="attribution",
                               name="smollm2-explorer-attribution.png")
    return [f"Attribution patching over the 16 pairs puts {100 * share:.0f}% of {dimension}'s total |score| in layers "
            f"{', '.join(str(int(t)) for t in top)} (layer {int(top[0])} first). The explorer, on the attribution "
            f"selector, with layer {int(top[0])} clicked:", "",
            f"![the explorer on SmolLM2's attribution scores](img/{shot.name})"], [shot]


def sweep_section(run: Path, img: Path, dimension: str) -> tuple[list[str], list[Path]]:
    sweep = read(run, "sweep/sweep.json")
    key = f"judge:{dimension}"
    from rolemrc.sweep.report import cell_label

    rows = [f"| cell | units | {dimension}: mean [95% CI] | vs baseline | vs controls (their mean) |", "|---|---|---|---|---|"]
    for cell in sweep["cells"]:
        e = cell["scores"].get(key)
        if e is None:
            continue
        base, ctrl = e["vs_baseline"], e.get("vs_controls")
        rows.append(f"| {cell_label(cell)} | {cell.get('units', '')} | {e['mean']:.3f} [{e['lo']:.3f}, {e['hi']:.3f}] | "
                    f"{base['diff']:+.3f}, Holm p {base.get('p_holm', base['p']):.2g} | "
                    + (f"{ctrl['diff']:+.3f} ({e['controls_mean']:.3f}), Holm p {ctrl.get('p_holm', ctrl['p']):.2g} |"
                       if ctrl else "- |"))
    picture = save_png((run / "sweep" / f"dose_{dimension}.png").read_bytes(), img / "smollm2-sweep-dose-response.png")
    return [f"Baseline (DPO) {dimension}: {sweep['baseline'].get(key, float('nan')):.3f}. {sweep['headline']}", "",
            *rows, "", f"![dose-response on SmolLM2, with 95% CI bands](img/{picture.name})"], [picture]


def traced_json(run: Path, command: str) -> dict:
    """The JSON a traced command printed in the transcript (the first object after its trace line)."""
    text = (run / "transcript.log").read_text()
    after = text[text.index(f"] {command}"):]
    return json.JSONDecoder().raw_decode(after[after.index("{"):])[0]


def restraint_section(run: Path, dimension: str) -> tuple[list[str], list[Path]]:
    from rolemrc.intervene.lora import VLLM_RANKS
    from rolemrc.intervene.spec import Restraint

    spec = Restraint.load(run / "restraint.yaml").summary()
    check = traced_json(run, "rolemrc intervene check")
    bake = traced_json(run, "rolemrc intervene bake")
    rank = read(run, "runs/dpo-restraint-lora/adapter_config.json")["r"]
    spread = spec["units_per_layer"]
    vllm = (f"within vLLM's largest LoRA rank ({VLLM_RANKS[-1]}), so vLLM can serve the adapter"
            if rank <= VLLM_RANKS[-1] else
            f"over vLLM's largest LoRA rank ({VLLM_RANKS[-1]}), so on vLLM this restraint is served baked, a "
            "checkpoint per A/B arm (`rolemrc ab bake`, then `ab create --baked`; docs/serve.md), as an 8B model's "
            "2,400 units a layer are")
    return [f"`intervene select` took {spec['units']:,} units ({100 * spec['share']:.0f}% of the model's "
            f"{spec['hook']} units; {spread['min']}-{spread['max']} per layer) for {dimension}, factor "
            f"{spec['factor']:g}. `intervene check`: {check['verdict']}. `intervene bake` wrote the checkpoint at "
            f"{bake['dtype']} ({bake['elements_changed_at_dtype']:,} weight elements changed). `intervene lora` wrote "
            f"an exact PEFT adapter of rank {rank}, one rank per unit of the widest layer: {vllm}."], []


def ab_section(run: Path, img: Path) -> tuple[list[str], list[Path]]:
    report = read(run, "ab/report.json")
    rows = ["| arm | requests | users | judge score per response [95% CI over users] | BLEU |", "|---|---|---|---|---|"]
    for name, arm in report["arms"].items():
        score = arm.get("judge", {}).get("response_score", {})
        bleu = arm.get("metrics", {}).get("bleu", {})
        rows.append(f"| {name} | {arm['n']} | {arm['users']} | {score.get('mean', float('nan')):.3f} "
                    f"[{score.get('lo', float('nan')):.3f}, {score.get('hi', float('nan')):.3f}] | "
                    f"{bleu.get('mean', float('nan')):.2f} |")
    tests = [f"- {pair}: judge score {t['judge_score']['diff']:+.3f} [{t['judge_score']['lo']:+.3f}, "
             f"{t['judge_score']['hi']:+.3f}], Welch p = {t['judge_score']['p']:.3g}"
             for pair, t in report["tests"].items() if "judge_score" in t]
    chart = save_png((run / "ab" / "chart.png").read_bytes(), img / "smollm2-ab-chart.png")
    return [f"{report['unit']['text']}.", "", *rows, "", *tests, "", f"![the A/B report's chart](img/{chart.name})"], [chart]


def organisms_only(run: Path) -> list[str]:
    """What a calibration that did not finish built: each organism's verdict on its target, first try and retries."""
    built = sorted((run / "calibration").glob("organisms*/*/organism.json"))
    lines = [f"- `{path.parent.parent.name}/{path.parent.name}`: {read(run, str(path.relative_to(run)))['headline']}"
             for path in built]
    return ["The calibration's grid (per organism: probes, attribution, sweeps against random units) had not finished "
            "when this page was made, so there is no recommendation and no recovery curve. The organisms it built, "
            "planted in this SFT model, and their verdicts:", "", *lines]


def calibration_section(run: Path, img: Path) -> tuple[list[str], list[Path]]:
    """The calibration the quickstart's aside runs (CALIBRATE=1): its headline, recommendation, recovery table and
    figure."""
    from rolemrc.organism.calibration_report import organism_label, recommendation_text

    if not (run / "calibration" / "calibration.json").exists():
        return organisms_only(run), []
    result = read(run, "calibration/calibration.json")
    rows = ["| organism | selector | factor | units per layer | undone (95% CI) | random-unit controls | found |",
            "|---|---|---|---|---|---|---|"]
    for c in result["recovery"]:
        found = "yes" if c["found"] else (f"no (broke {', '.join(c['broken'])})" if c["broken"] else "no")
        rows.append(f"| {organism_label(c)} ({c['dimension']}) | {c['selector']} | {c['factor']:g} | {c['per_layer']:g} "
                    f"| {c['share']:.0%} ({c['lo']:.0%} to {c['hi']:.0%}) | "
                    f"{', '.join(f'{x:.0%}' for x in c['controls']) or '-'} | {found} |")
    picture = save_png((run / "calibration" / "calibration.png").read_bytes(), img / "smollm2-calibration.png")
    return [f"**{result['headline']}**", "", recommendation_text(result["recommendation"]), "", *rows, "",
            f"![the recovery curve per planted organism (stars: found; crosses: broke another dimension)]"
            f"(img/{picture.name})"], [picture]


def page(run: Path, img: Path, time_note: str = "") -> tuple[str, list[Path]]:
    dimension, cost = cost_section(run)
    steps = [("1. What changed: the paired probe and its diff", lambda: diff_section(run, img, dimension), "diff/summary.json"),
             ("2. What matters to the preference: attribution", lambda: attribution_section(run, img, dimension),
              "explorer.html"),
             ("3. The evidence: the sweep against random units", lambda: sweep_section(run, img, dimension), "sweep/sweep.json"),
             ("4. The restraint, checked and exported", lambda: restraint_section(run, dimension),
              "runs/dpo-restraint-lora/adapter_config.json"),
             ("5. Live traffic: the A/B report", lambda: ab_section(run, img), "ab/report.json"),
             ("The aside: the recipe calibrated on organisms planted in this SFT model (`CALIBRATE=1`)",
              lambda: calibration_section(run, img), "calibration/organisms/stages.json")]
    sections = [(title, made, needs, (run / needs).exists()) for title, made, needs in steps]
    times = step_times(run)
    sections = [(title, made() if ready else ([f"Not reached when this page was made: the run had not written `{needs}`."], []))
                for title, made, needs, ready in sections]
    lines = ["# The researcher's path on SmolLM2, end to end", "",
             "README's quickstart block, run as written on two SmolLM2-135M-Instruct checkpoints named by hub id "
             "(`rolemrc-demo/smollm2-rp-sft`, `rolemrc-demo/smollm2-rp-dpo`) and found offline in an HF cache "
             "(`HF_HUB_OFFLINE=1`). The pair is LoRA SFT then LoRA DPO on the toolkit's own data (20 personas), as "
             "`make demo-real` trains it. Made by `scripts/smollm2_path.sh` (transcript: `transcript.log` in its "
             "folder); every figure below is read from that run's files by `scripts/smollm2_path_figures.py`.", "",
             "## 0. What DPO cost: both models evaluated (24 test cases, rules judge)", "", *cost, ""]
    written: list[Path] = []
    for title, (body, pictures) in sections:
        lines += [f"## {title}", "", *body, ""]
        written += pictures
    lines += ["## Time per step (2 CPU cores, no GPU)", "", "| step | seconds |", "|---|---|",
              *(f"| {step} | {seconds:.0f} |" for step, seconds in times),
              f"| the quickstart, in all | {sum(s for _, s in times):.0f} |", "", *([time_note, ""] if time_note else [])]
    return "\n".join(lines), written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a scripts/smollm2_path.sh folder")
    parser.add_argument("--img", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "researcher-path.md")
    parser.add_argument("--time-note", default="", help="what the page should say about this run's times")
    args = parser.parse_args(argv)
    text, written = page(args.run.resolve(), args.img, args.time_note)
    args.out.write_text(text)
    for path in [args.out, *written]:
        print(f"{path.stat().st_size / 1000:7.1f} kB  {path}")


if __name__ == "__main__":
    main()
