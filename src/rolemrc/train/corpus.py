"""Pretraining corpus for the embedded base model, gathered from any RoleMRC record files."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolemrc.train.data import BadRecord, DataReport, nonempty_text, pair_example, record_turns, scan, sft_example


@dataclass
class Corpus:
    """`texts` train the tokenizer (every record kind); `chats` and `plain` are pretrained on.

    Test records (`question`/`reference`) only feed the tokenizer: they are held out from
    pretraining so that evaluation stays clean."""

    texts: list[str] = field(default_factory=list)
    chats: list[list[dict[str, str]]] = field(default_factory=list)
    plain: list[str] = field(default_factory=list)
    _seen: set[str] = field(default_factory=set, repr=False)

    def add_chat(self, turns: list[dict[str, str]]) -> None:
        key = json.dumps(turns, ensure_ascii=False)
        if key not in self._seen:
            self._seen.add(key)
            self.chats.append(turns)
            self.texts.extend(t["content"] for t in turns)

    def add(self, record: dict[str, Any]) -> None:
        """File one record under its kind; raise BadRecord if it fits none."""
        if "conversations" in record:
            self.add_chat(sft_example(record)["messages"])
        elif any(k in record for k in ("chosen", "rejected")):
            pair = pair_example(record)
            self.add_chat(pair["prompt"] + pair["chosen"])
            self.texts.append(pair["rejected"][0]["content"])
        elif "passages" in record:
            passages = record["passages"]
            if not isinstance(passages, list) or not all(isinstance(p, str) for p in passages):
                raise BadRecord("malformed passages")
            parts = [*passages, nonempty_text(record.get("question"), "question")]
            if isinstance(record.get("answer"), str):
                parts.append(record["answer"])
            self.plain.append("\n".join(parts))
            self.texts.extend(parts)
        elif "question" in record:
            self.texts.extend(t["content"] for t in record_turns(record["question"]))
            self.texts.append(nonempty_text(record.get("reference"), "reference"))
        elif "text" in record:
            text = nonempty_text(record["text"], "text")
            self.plain.append(text)
            self.texts.append(text)
        else:
            raise BadRecord("unknown record kind")


def gather_corpus(files: list[Path], report: DataReport) -> Corpus:
    corpus = Corpus()
    scan(files, corpus.add, report)
    return corpus
