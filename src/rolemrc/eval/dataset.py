"""Test-set checks: `--dataset rolemrc` compares the task histogram with the published one."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rolemrc.core.errors import InputError, RolemrcError
from rolemrc.core.taxonomy import TASK_COUNTS

DATASETS = ("rolemrc",)


class DatasetDrift(RolemrcError, ValueError):
    """The test file does not match the published histogram."""


def histogram_drift(records: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """task -> (expected, found) for every task whose count differs from the RoleMRC release."""
    found = Counter(str(r.get("task")) for r in records)
    tasks = sorted(set(TASK_COUNTS) | set(found))
    return {t: (TASK_COUNTS.get(t, 0), found.get(t, 0)) for t in tasks if TASK_COUNTS.get(t, 0) != found.get(t, 0)}


def check_dataset(records: list[dict[str, Any]], dataset: str | None, *, allow_drift: bool = False) -> dict[str, Any]:
    """Refuse (DatasetDrift) a file that claims to be `dataset` but drifts, unless allow_drift; returns
    the check's report (rows, expected rows, drift)."""
    if dataset is None:
        return {}
    if dataset not in DATASETS:
        raise InputError(f"unknown dataset {dataset!r}; known: {DATASETS}")
    drift = histogram_drift(records)
    report = {"dataset": dataset, "rows": len(records), "expected_rows": sum(TASK_COUNTS.values()),
              "drift": {t: {"expected": e, "found": f} for t, (e, f) in drift.items()}}
    if drift and not allow_drift:
        lines = [f"  {t}: expected {e}, found {f}" for t, (e, f) in list(drift.items())[:20]]
        raise DatasetDrift(f"test file differs from the published RoleMRC histogram ({len(records)} rows, expected "
                           f"{report['expected_rows']}):\n" + "\n".join(lines) + "\npass --allow-drift to score it anyway")
    return report
