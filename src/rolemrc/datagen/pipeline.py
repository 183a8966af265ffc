"""The datagen run: personas -> profiles -> retrieval -> synthesis -> export, resumable.

Work lives in `<out>/work/`: a journal per slow stage (one line per finished persona/profile)
and the retrieval result. A rerun after a crash or SIGKILL skips finished units; every unit
draws from its own seeded RNG and the export is sorted, so the final files equal those of an
uninterrupted run.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from rolemrc.core.extras import require
from rolemrc.core.taxonomy import BASE_TASKS, TASK_COUNTS, TASKS
from rolemrc.datagen.backends import make_backend
from rolemrc.datagen.config import DatagenConfig, DatagenError, DroppedError, resolve_size
from rolemrc.datagen.export import export, write_json
from rolemrc.datagen.journal import Journal
from rolemrc.datagen.profiles import ProfileError, make_profile
from rolemrc.datagen.seeding import rng_for
from rolemrc.datagen.sources import load_personas, load_triplets
from rolemrc.datagen.synthesis import Material, Synthesizer


class ResumeMismatch(DatagenError):
    """The output directory holds work from a run with different settings."""


def allocate(total: int, weights: dict[str, int], cap: int) -> dict[str, int]:
    """Split `total` over the keys in proportion to `weights` (largest remainder), each in [1, cap]."""
    norm = sum(weights.values())
    exact = {k: total * w / norm for k, w in weights.items()}
    counts = {k: min(cap, max(1, math.floor(v))) for k, v in exact.items()}
    spare = total - sum(counts.values())
    for k in sorted(exact, key=lambda k: exact[k] - math.floor(exact[k]), reverse=True):
        if spare <= 0:
            break
        if counts[k] < cap:
            counts[k] += 1
            spare -= 1
    return counts


def test_plan(test_ids: list[str], rows: int) -> dict[str, list[str]]:
    """profile id -> its test tasks, covering all 18 tasks in the published proportions."""
    plan: dict[str, list[str]] = {pid: [] for pid in test_ids}
    cursor = 0
    for task, count in allocate(rows, TASK_COUNTS, cap=len(test_ids)).items():
        for j in range(count):
            plan[test_ids[(cursor + j) % len(test_ids)]].append(task)
        cursor += count
    return plan


def train_tasks(pid: str, index: int, seed: int) -> list[tuple[str, Any]]:
    """Work units of a training profile: one free chat, one on-scene chat, the 8 single-turn types,
    one nested, one prioritized and two multi-turn chats (variants drawn per profile)."""
    rng = rng_for(seed, "train-plan", pid)
    narr = lambda: rng.choice(("with", "no"))  # noqa: E731
    units: list[tuple[str, Any]] = [("free", (index % 2 == 0, (index // 2) % 2 == 0)), ("scene", rng.random() < 0.5)]
    units += [("mrc", t) for t in BASE_TASKS]
    units += [("mrc", f"role_related_mrc_answer_{narr()}_narration-{rng.choice(('special-content', 'special-format'))}"),
              ("mrc", f"role_related_mrc_answer_{narr()}_narration-refused"),
              ("mrc", f"role_related_mrc_refused_{narr()}_narration-2ndrefused"),
              ("mrc", f"role_unrelated_mrc_refused_{narr()}_narration-2ndanswer")]
    return units


def _bar(progress: bool, total: int, desc: str):
    return tqdm(total=total, desc=desc, unit="item", disable=not progress, leave=False)


def _check_resume(work: Path, config: DatagenConfig) -> None:
    path = work / "config.json"
    settings = config.fingerprint_fields()
    if path.exists():
        previous = json.loads(path.read_text(encoding="utf-8"))
        if previous != settings:
            changed = sorted(k for k in settings if previous.get(k) != settings[k])
            raise ResumeMismatch(f"{config.out} holds a run with other settings ({', '.join(changed)}); "
                                 "use another --out or delete it")
    else:
        work.mkdir(parents=True, exist_ok=True)
        write_json(path, settings)


async def _profiles(backend, personas, journal: Journal, progress: bool) -> None:
    todo = [p for p in personas if p["id"] not in journal.done]
    bar = _bar(progress, len(personas), "profiles")
    bar.update(len(personas) - len(todo))

    async def one(persona):
        try:
            name, components = await backend.profile(persona)
            journal.append({"key": persona["id"], "profile": make_profile(persona["id"], persona["persona"], name, components)})
        except ProfileError as exc:
            journal.append({"key": persona["id"], "dropped": str(exc)})
        bar.update(1)

    await asyncio.gather(*(one(p) for p in todo))
    bar.close()


def _retrieve(config: DatagenConfig, profiles: list[dict], triplets: list[dict], work: Path) -> dict[str, dict[str, str]]:
    """profile id -> ids of its related (answerable), unanswerable and unrelated triplets (cached)."""
    path = work / "retrieval.json"
    if path.exists():
        cached = json.loads(path.read_text(encoding="utf-8"))
        if set(cached) == {p["id"] for p in profiles}:
            return cached
    from rolemrc.datagen.retrieval import embed, extremes, load_embedder

    answerable = [t for t in triplets if t["answer"] is not None]
    unanswerable = [t for t in triplets if t["answer"] is None]
    if not answerable or not unanswerable:
        raise DatagenError("the MRC pool needs both answerable and unanswerable (answer null) triplets")
    model = load_embedder(config.embedder)
    p_vec = embed(model, [" ".join((p["components"]["name_and_description"], p["components"]["abilities_and_skills"],
                                    p["components"]["knowledge_boundaries"])) for p in profiles], progress=config.progress)
    keys = {"answerable": answerable, "unanswerable": unanswerable}
    t_vec = {k: embed(model, [t["question"] + " " + " ".join(t["passages"]) for t in pool], progress=config.progress)
             for k, pool in keys.items()}
    opts = {"nlist": config.ivf_nlist, "nprobe": config.ivf_nprobe}
    a = extremes(p_vec, t_vec["answerable"], config.index, **opts)
    u = extremes(p_vec, t_vec["unanswerable"], config.index, **opts)
    result = {p["id"]: {"related": answerable[a.top[i]]["id"], "unanswerable": unanswerable[u.top[i]]["id"],
                        "unrelated": answerable[a.bottom[i]]["id"]} for i, p in enumerate(profiles)}
    write_json(path, result)
    return result


async def _synthesise(synth: Synthesizer, units_of: dict[str, list], profiles: dict[str, dict], material: dict[str, Material],
                      split_of: dict[str, str], journal: Journal, progress: bool) -> None:
    todo = [pid for pid in units_of if pid not in journal.done]
    bar = _bar(progress, len(units_of), "synthesis")
    bar.update(len(units_of) - len(todo))

    async def unit(pid: str, kind: str, arg: Any):
        profile, mat = profiles[pid], material[pid]
        if kind == "free":
            return await synth.free_chat(profile, *arg)
        if kind == "scene":
            return await synth.on_scene(profile, mat, arg)
        return await synth.mrc(profile, mat, arg)

    async def one(pid: str):
        results = await asyncio.gather(*(unit(pid, kind, arg) for kind, arg in units_of[pid]), return_exceptions=True)
        items, dropped = [], Counter()
        for result in results:
            if isinstance(result, DroppedError):
                dropped[str(result)] += 1
            elif isinstance(result, BaseException):
                raise result
            else:
                items.append({"task": result.task, "turns": result.turns, "rejected": result.rejected})
        journal.append({"key": pid, "split": split_of[pid], "items": items, "dropped": dict(dropped)})
        bar.update(1)

    await asyncio.gather(*(one(pid) for pid in todo))
    bar.close()


async def arun(config: DatagenConfig) -> dict[str, Any]:
    """Run (or resume) every stage; return the stats, the backend's event counts and each stage's seconds."""
    require("datagen", what="data synthesis")
    out, work = config.out, config.out / "work"
    personas = load_personas(config.personas)   # the sources are read before anything is written
    triplets = load_triplets(config.mrc)
    _check_resume(work, config)
    n_personas, test_rows = resolve_size(config.size)
    n = len(personas) if n_personas == 0 else min(n_personas, len(personas))
    personas = rng_for(config.seed, "personas").sample(personas, n)
    backend = make_backend(config.backend, seed=config.seed, cache_path=work / "cache.sqlite")
    drops: dict[str, Counter] = {"profiles": Counter(), "synthesis": Counter()}
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        seconds[stage] = round(time.perf_counter() - clock, 3)
        clock = time.perf_counter()

    try:
        pj = Journal(work / "profiles.jsonl")
        await _profiles(backend, personas, pj, config.progress)
        pj.close()
        lap("profiles")
        profiles = [pj.done[p["id"]]["profile"] for p in personas if "profile" in pj.done[p["id"]]]
        drops["profiles"].update(pj.done[p["id"]]["dropped"] for p in personas if "dropped" in pj.done[p["id"]])
        if len(profiles) < 2:
            export(out, profiles, [], drops)
            return {"stats": json.loads((out / "stats.json").read_text()), "events": dict(backend.events),
                    "seconds": seconds}
        by_id = {t["id"]: t for t in triplets}
        chosen = _retrieve(config, profiles, triplets, work)
        lap("retrieval")
        material = {pid: Material(*(by_id[ids[k]] for k in ("related", "unanswerable", "unrelated")))
                    for pid, ids in chosen.items()}
        ids = [p["id"] for p in profiles]
        order = rng_for(config.seed, "split").sample(ids, len(ids))
        test_ids = order[: min(len(ids) - 1, max(1, math.ceil(config.test_fraction * len(ids))))]
        plan = test_plan(test_ids, test_rows)
        split_of = {pid: ("test" if pid in plan else "train") for pid in ids}
        units_of = {}
        train_index = 0
        for pid in ids:
            if pid in plan:
                units_of[pid] = [("mrc", t) for t in sorted(plan[pid], key=TASKS.index)]
            else:
                units_of[pid] = train_tasks(pid, train_index, config.seed)
                train_index += 1
        ij = Journal(work / "items.jsonl")
        await _synthesise(Synthesizer(backend, config.seed), units_of, {p["id"]: p for p in profiles}, material,
                          split_of, ij, config.progress)
        ij.close()
        lap("synthesis")
        units = [ij.done[pid] for pid in ids]
        for u in units:
            drops["synthesis"].update(u["dropped"])
        profile_records = [{**p, "split": split_of[p["id"]]} for p in profiles]
        stats = export(out, profile_records, units, drops)
    finally:
        if hasattr(backend, "aclose"):
            await backend.aclose()
    return {"stats": stats, "events": dict(backend.events), "seconds": seconds}


def run(config: DatagenConfig) -> dict[str, Any]:
    """Synchronous entry point (see `arun`)."""
    return asyncio.run(arun(config))
