"""Persona and MRC-triplet sources: the bundled sample data and loaders for the real corpora.

Personas: bundled `data/personas.jsonl` or PersonaHub-style JSONL (a `persona` field).
Triplets: bundled `data/mrc.jsonl` / RoleMRC-style JSONL (`passages`, `question`, `answer`, null =
unanswerable) or MS MARCO v2.1-style JSONL/Parquet (`query`, `passages.passage_text`, `answers`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rolemrc.core.artifacts import JSONL_INPUT, expect
from rolemrc.core.io import JsonlError, iter_jsonl

DATA_DIR = Path(__file__).parent / "data"
BUNDLED_PERSONAS = DATA_DIR / "personas.jsonl"
BUNDLED_MRC = DATA_DIR / "mrc.jsonl"
MSMARCO_NO_ANSWER = "No Answer Present."


def load_personas(path: str | os.PathLike | None = None) -> list[dict[str, str]]:
    """[{"id", "persona"}] from PersonaHub-style JSONL (ids default to `p<line>`)."""
    path = Path(path) if path else BUNDLED_PERSONAS
    expect(path, JSONL_INPUT, "expected personas: PersonaHub-style JSONL with a 'persona' field")
    out, seen = [], set()
    for lineno, record in iter_jsonl(path):
        persona = record.get("persona")
        if not isinstance(persona, str) or not persona.strip():
            raise JsonlError(f"{path}:{lineno}: expected a non-empty string field 'persona'")
        pid = str(record.get("id", f"p{lineno}"))
        if pid in seen:
            raise JsonlError(f"{path}:{lineno}: duplicate persona id {pid!r}")
        seen.add(pid)
        out.append({"id": pid, "persona": " ".join(persona.split())})
    if not out:
        raise JsonlError(f"{path}: no personas")
    return out


def _triplet(record: dict[str, Any], where: str, default_id: str) -> dict[str, Any]:
    """One record (RoleMRC or MS MARCO shape) -> {"id", "passages", "question", "answer"[, "domain"]}."""
    if "query" in record:  # MS MARCO v2.1
        passages = record.get("passages")
        texts = passages.get("passage_text") if isinstance(passages, dict) else None
        answers = [a for a in (record.get("answers") or []) if isinstance(a, str) and a.strip()]
        answer = answers[0] if answers and answers[0] != MSMARCO_NO_ANSWER else None
        question, tid = record["query"], record.get("query_id", default_id)
    else:
        texts, question, answer = record.get("passages"), record.get("question"), record.get("answer")
        tid = record.get("id", default_id)
    if texts is not None and not isinstance(texts, list):  # parquet yields numpy arrays
        texts = list(texts)
    if not texts or not all(isinstance(t, str) and t.strip() for t in texts):
        raise JsonlError(f"{where}: 'passages' must be a non-empty list of non-empty strings")
    if not isinstance(question, str) or not question.strip():
        raise JsonlError(f"{where}: 'question' must be a non-empty string")
    if answer is not None and (not isinstance(answer, str) or not answer.strip()):
        raise JsonlError(f"{where}: 'answer' must be a non-empty string or null (unanswerable)")
    out = {"id": str(tid), "passages": [t.strip() for t in texts], "question": question.strip(), "answer": answer}
    if isinstance(record.get("domain"), str):
        out["domain"] = record["domain"]
    return out


def _raw_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    expect(path, (*JSONL_INPUT, "parquet"), "expected MRC triplets: JSONL with passages, question and answer, or MS "
           "MARCO v2.1 JSONL/Parquet")
    if path.suffix == ".parquet":
        import pandas as pd

        for row, record in enumerate(pd.read_parquet(path).to_dict("records"), start=1):
            yield f"{path}:row {row}", record
    else:
        for lineno, record in iter_jsonl(path):
            yield f"{path}:{lineno}", record


def load_triplets(path: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """MRC triplets from RoleMRC-style JSONL or MS MARCO v2.1 JSONL/Parquet; ids must be unique."""
    path = Path(path) if path else BUNDLED_MRC
    out, seen = [], set()
    for k, (where, record) in enumerate(_raw_records(path), start=1):
        triplet = _triplet(record, where, f"m{k}")
        if triplet["id"] in seen:
            raise JsonlError(f"{where}: duplicate triplet id {triplet['id']!r}")
        seen.add(triplet["id"])
        out.append(triplet)
    if not out:
        raise JsonlError(f"{path}: no triplets")
    return out
