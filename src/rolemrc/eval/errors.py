"""Errors shared by eval's modules."""

from __future__ import annotations

from rolemrc.core.errors import RolemrcError


class MetricUnavailable(RolemrcError, RuntimeError):
    """A resource a metric needs is missing; `metrics.compute` reports the group as unavailable instead of stopping."""
