"""Export: the final record files and a Table-2-style statistics table."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from rolemrc.core.io import write_json, write_jsonl, write_text
from rolemrc.core.taxonomy import TASKS, split_task

CATEGORIES = ("free chat", "on-scene chat", "single-turn MRC", "multi-turn", "nested", "prioritized")


def category(task: str) -> str:
    if task.startswith("free_chat"):
        return "free chat"
    if task.startswith("on_scene_chat"):
        return "on-scene chat"
    variant = split_task(task)[1]
    if variant is None:
        return "single-turn MRC"
    return {"2ndrefused": "multi-turn", "2ndanswer": "multi-turn", "refused": "prioritized"}.get(variant, "nested")


def records_from_items(pid: str, items: list[dict[str, Any]], split: str) -> dict[str, list[dict[str, Any]]]:
    """SFT records and preference pairs (train split) or test records (test split) of one profile."""
    out: dict[str, list[dict[str, Any]]] = {"sft": [], "pairs": [], "test": []}
    for item in items:
        rid, turns, task = f"{pid}/{item['task']}", item["turns"], item["task"]
        if split == "test":
            out["test"].append({"id": rid, "question": turns[:-1], "reference": turns[-1]["content"], "task": task})
            continue
        out["sft"].append({"id": rid, "conversations": turns, "task": task})
        if item.get("rejected") is not None:
            out["pairs"].append({"id": rid, "prompt": turns[:-1], "chosen": turns[-1]["content"],
                                 "rejected": item["rejected"], "task": task})
    return out


def _words(text: str) -> int:
    return len(text.split())


def stats_table(files: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, dict[str, float]]]:
    """{file: {category: {count, turns, words_per_reply}}}; turns count non-system messages."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for name, records in files.items():
        groups: dict[str, list[tuple[int, list[int]]]] = defaultdict(list)
        for r in records:
            turns = r.get("conversations") or r.get("question") or r.get("prompt")
            body = [t for t in turns if t["role"] != "system"]
            replies = [_words(t["content"]) for t in body if t["role"] == "assistant"]
            extra = [r[k] for k in ("chosen", "reference") if k in r]
            groups[category(r["task"])].append((len(body) + len(extra), replies + [_words(e) for e in extra]))
        rows = {}
        for cat in (*CATEGORIES, "all"):
            members = [g for c, gs in groups.items() if cat in (c, "all") for g in gs]
            if members:
                words = [w for _, ws in members for w in ws]
                rows[cat] = {"count": len(members), "turns": round(sum(t for t, _ in members) / len(members), 2),
                             "words_per_reply": round(sum(words) / max(1, len(words)), 1)}
        table[name] = rows
    return table


def stats_markdown(table: dict[str, dict[str, dict[str, float]]], drops: dict[str, Counter]) -> str:
    lines = ["| file | category | count | turns/record | words/reply |", "|---|---|---:|---:|---:|"]
    for name, rows in table.items():
        for cat, row in rows.items():
            lines.append(f"| {name} | {cat} | {row['count']} | {row['turns']} | {row['words_per_reply']} |")
    for stage, reasons in drops.items():
        if reasons:
            lines.append("")
            lines.append(f"Dropped at {stage}: " + ", ".join(f"{r} x{n}" for r, n in sorted(reasons.items())))
    return "\n".join(lines) + "\n"


def export(out: Path, profiles: list[dict[str, Any]], units: list[dict[str, Any]], drops: dict[str, Counter]) -> dict:
    """Write profiles/sft/pairs/test JSONL and stats.{json,md}; units come in profile order."""
    files: dict[str, list[dict[str, Any]]] = {"sft": [], "pairs": [], "test": []}
    for unit in units:
        for name, recs in records_from_items(unit["key"], unit["items"], unit["split"]).items():
            files[name].extend(recs)
    order = {t: i for i, t in enumerate(TASKS)}
    files["test"].sort(key=lambda r: order[r["task"]])  # stable: profile order within a task
    write_jsonl(out / "profiles.jsonl", profiles)
    for name, recs in files.items():
        write_jsonl(out / f"{name}.jsonl", recs)
    table = stats_table(files)
    test_tasks = Counter(r["task"] for r in files["test"])
    stats = {"table": table, "test_tasks": {t: test_tasks.get(t, 0) for t in TASKS},
             "profiles": len(profiles), "dropped": {k: dict(sorted(v.items())) for k, v in drops.items()}}
    write_json(out / "stats.json", stats)
    write_text(out / "stats.md", stats_markdown(table, drops))
    return stats
