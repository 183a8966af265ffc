"""Where a change lives, without the restraint grid: a units organism per seed (its own S), probed as the calibration
probes, every selector scored against S (`detection`), aggregated over the seeds. `organism calibrate` does the same
for its units organisms beside the grid; this is the cheaper look at detection alone (`rolemrc organism localize`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rolemrc.organism.calibration_config import CalibrationConfig
from rolemrc.organism.config import KNOWN, OrganismConfig, OrganismError
from rolemrc.organism.detection import detection_summary, headline, organism_detection


def seed_detection(root: Path, seed: int, config: CalibrationConfig, *, base: str = "smollm2",
                   settings: dict[str, Any] | None = None, probe_n: int = 48) -> dict[str, Any]:
    """The units organism of `seed` built under `root` (its own S, pairs and training), probed as calibration
    probes it (`calibration.probe_stages`, on `probe_n` pair prompts of its planted dimension it did not train on),
    every selector of `config` scored against its S in that dimension (`seed_row`, with the seed, S and the carrier
    check's KL). An organism that missed its behavioural target is read all the same, and says so."""
    from rolemrc.core.io import read_jsonl, write_jsonl
    from rolemrc.core.stages import StageCache
    from rolemrc.core.taxonomy import dimensions_for_task
    from rolemrc.organism.build import build_organism
    from rolemrc.organism.calibration import probe_cases, probe_stages
    from rolemrc.organism.calibration_config import Organism

    cache = StageCache(root)
    report = build_organism(OrganismConfig(kind=KNOWN, out=str(root), base=base, seed=seed, **(settings or {})),
                            cache=cache)
    probe, source, dimension = root / "probe-cases.jsonl", root / "data" / "pairs.jsonl", report["planted_dimension"]
    # pair prompts of the planted dimension's tasks (the table every selector reads) that the organism did not train on
    skip = sorted({p["id"] for p in read_jsonl(report["pairs"])}
                  | {r["id"] for r in read_jsonl(source) if dimension not in dimensions_for_task(r.get("task"))})
    cache.run("probe cases", {"pairs": source, "skip": skip, "n": probe_n},
              lambda: {"cases": write_jsonl(probe, probe_cases(source, set(skip), probe_n, seed))}, [probe])
    organism = Organism.from_report(report, probe)
    inputs = probe_stages(cache, organism, config, root / KNOWN)
    return {**organism_detection(organism, inputs, seed, config.selectors),
            "known_units": report["known_units"], "carrier": report["carrier"]["kl"]}


def check_settings(config: CalibrationConfig, seeds: list[int], settings: dict[str, Any]) -> None:
    """Refuse, before anything trains, what `known_detection` cannot run: a hook point whose units are not the MLP's
    (S is a set of MLP units), no seed or a repeated one, an organism setting OrganismConfig refuses."""
    from rolemrc.core.hooks import hook_point

    if hook_point(config.hook).width != "intermediate":
        raise OrganismError(f"--hook {config.hook}: its units are not the MLP's, and the known units are; give "
                            "mlp.act or mlp.post")
    if not seeds or len(set(seeds)) != len(seeds):
        raise OrganismError(f"--seeds: give one or more distinct seeds, got {seeds}")
    OrganismConfig(kind=KNOWN, out=config.out, **settings)


def known_detection(out: Path, seeds: list[int], config: CalibrationConfig, *, settings: dict[str, Any] | None = None,
                    **options: Any) -> dict[str, Any]:
    """`seed_detection` per seed under out/seed-<s> (`options`: its base, probe_n), aggregated over the seeds (the
    calibration's `detection_summary`); writes out/detection.json, detection.md and detection.html/png."""
    from rolemrc.core.io import write_json
    from rolemrc.organism.calibration_report import detection_figure, detection_markdown

    check_settings(config, seeds, settings or {})
    rows = [seed_detection(out / f"seed-{seed}", seed, config, settings=settings, **options) for seed in seeds]
    detection = detection_summary([{KNOWN: row} for row in rows])
    result = {"seeds": rows, "detection": detection, "headline": headline(detection[KNOWN]["summary"])}
    result["figure"] = detection_figure(detection, out)
    write_json(out / "detection.json", result)
    lines = [f"# Where the change lives: {len(seeds)} units organism(s)", "", result["headline"] + ".",
             *detection_markdown(detection), "", "| seed | organism | units in S | KL of the DPO model to SFT "
             "(last token) | S reverted | as many random units reverted |", "|---|---|---|---|---|---|"]
    for row in rows:
        kl, size = row["carrier"], sum(len(u) for u in row["known_units"].values())
        lines.append(f"| {row['seed']} | {row['organism']} | {size} | {kl['dpo']['last']:.3g} | "
                     f"{kl['s_reverted']['last']:.3g} | {kl['random_reverted']['last']:.3g} |")
    (out / "detection.md").write_text("\n".join(lines) + "\n")
    return result
