"""Judge verdicts: one binary score per (item, aspect), or None with the reason it has no score."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from rolemrc.core.taxonomy import Aspect

UNPARSEABLE = "unparseable"   # a judge replied, but no single 0/1 verdict could be read
UNJUDGEABLE = "unjudgeable"   # the rules judge has no exact check for this item

_MARKUP = re.compile(r"[*_`#>|]+")
_LABELLED = re.compile(r"\b(?:score|verdict|rating|grade|result|judg(?:e)?ment)\b\s*(?:is|of|=|:|-)?\s*\(?\s*"
                       r"([01])(?:\s*(?:/|out\s+of)\s*(\d+))?(?!\d|\.\d|\s*(?:or|and)\s*[01])", re.I)
_BARE = re.compile(r"^\s*\(?([01])\)?\s*[.!]?\s*$")


@dataclass
class Verdict:
    """One judge call's outcome. `score` is 1 / 0, or None with `status` saying why."""

    id: str
    task: str
    dimension: str
    detail: str | None
    score: int | None
    status: str = "ok"           # ok | unparseable | unjudgeable
    reason: str = ""
    raw: str | None = None       # the judge's reply (openai judge)
    damage: str | None = None    # the reply's damage kind (eval.damage.KINDS): scored 0, the judge not asked

    @classmethod
    def make(cls, item_id: str, task: str, aspect: Aspect, score: int | None, status: str = "ok", reason: str = "",
             raw: str | None = None, damage: str | None = None) -> Verdict:
        return cls(item_id, task, aspect.dimension, aspect.detail, score, status, reason, raw, damage)

    def to_dict(self) -> dict:
        return asdict(self)


def parse_verdict(text: str | None) -> int | None:
    """Read a binary verdict from a judge reply ("Score: 1", "1", "**1**", "The score is 0.").

    Returns None when there is no verdict or when the reply states conflicting ones; never guesses.
    """
    if not isinstance(text, str):
        return None
    clean = _MARKUP.sub(" ", text)
    labelled = {int(value) if scale in ("", "1") else -1 for value, scale in _LABELLED.findall(clean)}
    if labelled:
        return labelled.pop() if len(labelled) == 1 and -1 not in labelled else None
    bare = {int(m.group(1)) for line in clean.splitlines() if (m := _BARE.match(line))}
    return bare.pop() if len(bare) == 1 else None
