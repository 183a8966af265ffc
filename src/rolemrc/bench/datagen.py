"""`rolemrc bench datagen`: the template backend and a served model writing the same data, side by side.

Both runs sample the same personas (same size and seed) into fresh output directories, so nothing comes from
the SQLite cache. Per backend: wall time per stage, records written, records per minute (overall, and over the
generation stages only: retrieval is the same work for both), the share of replies rejected as malformed and of
profiles and items dropped after every attempt, and three examples (the same profile and task in each run, one per category)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from rolemrc.core.errors import InputError
from rolemrc.core.io import read_jsonl
from rolemrc.datagen.config import BackendConfig, DatagenConfig
from rolemrc.datagen.export import CATEGORIES, category
from rolemrc.datagen.pipeline import run as run_datagen

EXAMPLE_CHARS = 600


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def _per_min(count: int, seconds: float) -> float | None:
    return round(60 * count / seconds, 2) if seconds > 0 else None


def measure(config: DatagenConfig) -> dict[str, Any]:
    """Run datagen once (cold) and describe its throughput and losses."""
    if (config.out / "work").exists():
        raise InputError(f"{config.out} already holds a datagen run; the benchmark needs a fresh directory")
    start = time.perf_counter()
    result = run_datagen(config)
    wall = time.perf_counter() - start
    stats, events, seconds = result["stats"], result["events"], result["seconds"]
    records = {name: rows.get("all", {}).get("count", 0) for name, rows in stats["table"].items()}
    total = sum(records.values())
    items_file = config.out / "work" / "items.jsonl"
    kept_items = sum(len(u.get("items", [])) for u in read_jsonl(items_file)) if items_file.exists() else 0
    dropped = {stage: sum(reasons.values()) for stage, reasons in stats["dropped"].items()}
    generation_s = seconds.get("profiles", 0.0) + seconds.get("synthesis", 0.0)
    replies = events.get("requests", 0) - events.get("retries", 0) + events.get("cache_hits", 0)
    out = {
        "wall_s": round(wall, 2), "seconds": seconds, "records": {**records, "total": total},
        "records_per_min": _per_min(total, wall), "generation_records_per_min": _per_min(total, generation_s),
        "profiles": {"kept": stats["profiles"], "dropped": dropped.get("profiles", 0),
                     "dropped_share": _share(dropped.get("profiles", 0), stats["profiles"] + dropped.get("profiles", 0))},
        "items": {"kept": kept_items, "dropped": dropped.get("synthesis", 0),
                  "dropped_share": _share(dropped.get("synthesis", 0), kept_items + dropped.get("synthesis", 0))},
        "drop_reasons": stats["dropped"],
    }
    if config.backend.name == "openai":
        out["events"] = events
        out["replies"] = replies
        out["malformed_reply_share"] = _share(events.get("malformed", 0), replies)
        if events.get("completion_tokens"):
            out["completion_tokens_per_s"] = round(events["completion_tokens"] / generation_s, 1) if generation_s else None
    return out


def examples(dirs: dict[str, Path], count: int = 3) -> list[dict[str, Any]]:
    """SFT records of the same profile and task in every run, one per category in the paper's order, each
    run's last two turns side by side (fewer when the runs share fewer)."""
    by_run: dict[str, dict[str, dict]] = {}
    for name, root in dirs.items():
        path = root / "sft.jsonl"
        by_run[name] = {record["id"]: record for record in (read_jsonl(path) if path.exists() else [])}
    shared = set.intersection(*(set(records) for records in by_run.values())) if by_run else set()
    first = next(iter(by_run.values()), {})
    picked: list[str] = []
    for cat in CATEGORIES:
        ids = [rid for rid in first if rid in shared and category(first[rid]["task"]) == cat]
        picked += ids[:1]

    def tail(record: dict[str, Any]) -> list[dict[str, str]]:
        return [{"role": t["role"], "content": t["content"][:EXAMPLE_CHARS]} for t in record["conversations"][-2:]]

    return [{"id": rid, "task": first[rid]["task"], **{name: tail(by_run[name][rid]) for name in dirs}}
            for rid in picked[:count]]


def run(base_url: str | None, model: str | None, *, size: str | int = "tiny", seed: int = 0, concurrency: int = 16,
        timeout_s: float = 300.0, max_tokens: int = 512, seed_requests: bool = True, structured: bool = False,
        mrc: Path | None = None,
        keep: Path | None = None, progress: bool = True) -> dict[str, Any]:
    """Template backend, then (with `base_url`) the openai backend against it; both cold, same personas."""
    if base_url and not model:
        raise InputError("name the served model with --model (GET <base-url>/models lists them)")
    with tempfile.TemporaryDirectory(prefix="rolemrc-bench-datagen-") as tmp:
        root = Path(keep) if keep else Path(tmp)
        backends = {"template": BackendConfig()}
        if base_url:
            backends["openai"] = BackendConfig(name="openai", base_url=base_url, model=model, concurrency=concurrency,
                                               timeout_s=timeout_s, max_tokens=max_tokens, seed_requests=seed_requests,
                                               structured=structured)
        dirs = {name: root / name for name in backends}
        results = {name: measure(DatagenConfig(out=dirs[name], size=size, seed=seed, mrc=mrc, progress=progress,
                                               backend=backend))
                   for name, backend in backends.items()}
        report: dict[str, Any] = {"size": size, "seed": seed, "base_url": base_url, "model": model,
                                  "concurrency": concurrency, "max_tokens": max_tokens, "structured": structured,
                                  **results}
        if base_url:
            template, served = results["template"], results["openai"]
            report["served_over_template"] = {
                key: float(f"{served[key] / template[key]:.3g}") if served[key] and template[key] else None
                for key in ("records_per_min", "generation_records_per_min")}
            report["records_kept_share"] = _share(served["records"]["total"], template["records"]["total"])
        report["examples"] = examples(dirs)
        return report
