"""Where a change lives, without the restraint grid: a units organism per seed (its own S), probed as the calibration
probes, every selector scored against S (`detection`), aggregated over the seeds. `organism calibrate` does the same
for its units organisms beside the grid; this is the cheaper look at detection alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rolemrc.organism.calibration_config import CalibrationConfig
from rolemrc.organism.config import KNOWN
from rolemrc.organism.detection import aggregate, detect, headline
from rolemrc.organism.known import units_of


def seed_detection(root: Path, seed: int, config: CalibrationConfig, *, base: str = "smollm2",
                   settings: dict[str, Any] | None = None, probe_n: int = 48) -> dict[str, Any]:
    """The units organism of `seed` built under `root` (its own S, pairs and training), probed as calibration
    probes it (`calibration.probe_stages`, on `probe_n` pair prompts of its planted dimension it did not train on),
    every selector of `config` scored against its S in that dimension."""
    from rolemrc.core.io import read_jsonl, write_jsonl
    from rolemrc.core.stages import StageCache
    from rolemrc.core.taxonomy import dimensions_for_task
    from rolemrc.organism.build import build_organism
    from rolemrc.organism.calibration import probe_cases, probe_stages
    from rolemrc.organism.calibration_config import Organism
    from rolemrc.organism.config import OrganismConfig

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
    return {"seed": seed, "known_units": report["known_units"], "carrier": report["carrier"]["kl"],
            "selectors": detect(inputs, dimension, units_of(report["known_units"]), config.selectors)}


def known_detection(out: Path, seeds: list[int], config: CalibrationConfig, **options: Any) -> dict[str, Any]:
    """`seed_detection` per seed under out/seed-<s> (`options`: its base, settings, probe_n), aggregated over the
    seeds; writes out/detection.json."""
    from rolemrc.core.io import write_json

    rows = [seed_detection(out / f"seed-{seed}", seed, config, **options) for seed in seeds]
    summary = aggregate([r["selectors"] for r in rows])
    result = {"seeds": rows, "aggregate": summary, "headline": headline(summary)}
    write_json(out / "detection.json", result)
    return result
