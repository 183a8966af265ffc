"""The RoleMRC task -> evaluation dimension taxonomy (facts from the RoleMRC release)."""

from __future__ import annotations

from dataclasses import dataclass

DIMENSIONS: tuple[str, ...] = ("knowledge_boundary", "role_style", "multi_turn", "nested", "prioritized")

BASE_TASKS: tuple[str, ...] = tuple(
    f"role_{rel}_mrc_{act}_{narr}_narration"
    for rel in ("related", "unrelated")
    for act in ("answer", "refused")
    for narr in ("with", "no")
)


@dataclass(frozen=True)
class Aspect:
    """One judge call: the dimension it scores and, where relevant, which side of it."""

    dimension: str
    detail: str | None = None  # within/outside (knowledge), answerable/unanswerable (multi_turn)


# Judge aspects of the 8 base tasks (docs/ARCHITECTURE.md "Taxonomy").
_BASE_ASPECTS: dict[str, tuple[Aspect, ...]] = {
    "role_related_mrc_answer_with_narration": (Aspect("knowledge_boundary", "within"), Aspect("role_style")),
    "role_related_mrc_answer_no_narration": (Aspect("knowledge_boundary", "within"),),
    "role_unrelated_mrc_refused_with_narration": (Aspect("knowledge_boundary", "outside"),),
    "role_unrelated_mrc_refused_no_narration": (Aspect("knowledge_boundary", "outside"), Aspect("role_style")),
    "role_related_mrc_refused_with_narration": (Aspect("knowledge_boundary", "within"),),
    "role_unrelated_mrc_answer_with_narration": (Aspect("knowledge_boundary", "outside"),),
    "role_related_mrc_refused_no_narration": (Aspect("role_style"),),
    "role_unrelated_mrc_answer_no_narration": (Aspect("role_style"),),
}

# Variant suffix -> (base tasks it applies to, its single judge aspect).
_VARIANTS: dict[str, tuple[tuple[str, ...], Aspect]] = {
    "special-content": (("role_related_mrc_answer_with_narration", "role_related_mrc_answer_no_narration"), Aspect("nested")),
    "special-format": (("role_related_mrc_answer_with_narration", "role_related_mrc_answer_no_narration"), Aspect("nested")),
    "refused": (("role_related_mrc_answer_with_narration", "role_related_mrc_answer_no_narration"), Aspect("prioritized")),
    "2ndrefused": (("role_related_mrc_refused_with_narration", "role_related_mrc_refused_no_narration"),
                   Aspect("multi_turn", "unanswerable")),
    "2ndanswer": (("role_unrelated_mrc_refused_with_narration", "role_unrelated_mrc_refused_no_narration"),
                  Aspect("multi_turn", "answerable")),
}

# The published 1,400-row test histogram (18 task names), as counted in the release's roleMRC_test.jsonl
# (NeMo-Gym's RoleMRC server pins the same counts).
TASK_COUNTS: dict[str, int] = {
    **dict.fromkeys(BASE_TASKS, 100),
    "role_related_mrc_answer_with_narration-special-content": 58,
    "role_related_mrc_answer_no_narration-special-content": 58,
    "role_related_mrc_answer_with_narration-special-format": 20,
    "role_related_mrc_answer_no_narration-special-format": 22,
    "role_related_mrc_answer_with_narration-refused": 22,
    "role_related_mrc_answer_no_narration-refused": 20,
    "role_related_mrc_refused_with_narration-2ndrefused": 100,
    "role_related_mrc_refused_no_narration-2ndrefused": 100,
    "role_unrelated_mrc_refused_with_narration-2ndanswer": 100,
    "role_unrelated_mrc_refused_no_narration-2ndanswer": 100,
}

TASKS: tuple[str, ...] = tuple(TASK_COUNTS)


def split_task(task: str) -> tuple[str, str | None]:
    """Split a task name into (base task, variant suffix or None)."""
    base, sep, variant = task.partition("-")
    return base, (variant if sep else None)


def is_known_task(task: str | None) -> bool:
    if not task:
        return False
    base, variant = split_task(task)
    if base not in _BASE_ASPECTS:
        return False
    return variant is None or (variant in _VARIANTS and base in _VARIANTS[variant][0])


def judge_aspects_for_task(task: str) -> tuple[Aspect, ...]:
    """The judge calls a test item of this task receives (empty for unknown tasks)."""
    if not is_known_task(task):
        return ()
    base, variant = split_task(task)
    if variant is None:
        return _BASE_ASPECTS[base]
    return (_VARIANTS[variant][1],)


def dimensions_for_task(task: str | None) -> tuple[str, ...]:
    """Dimensions a case of this task counts in (ordered as DIMENSIONS; empty if unknown)."""
    if not task:
        return ()
    dims = {a.dimension for a in judge_aspects_for_task(task)}
    return tuple(d for d in DIMENSIONS if d in dims)
