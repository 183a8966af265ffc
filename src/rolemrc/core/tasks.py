"""Independent tasks (a calibration's seeds), run one after another in this process, or as tasks on an existing Ray
cluster (`--ray ADDRESS`, the `ray` extra). Every task reads and writes the same folders, so a cluster needs them on
a filesystem its nodes share; a task's stages are cached there, so a rerun resumes either way."""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from rolemrc.core.errors import RolemrcError
from rolemrc.core.extras import require

T = TypeVar("T")
R = TypeVar("R")


class RayAddressError(RolemrcError, ValueError):
    """A `--ray` address that is not host:port or that nothing answers on."""


def check_ray(address: str, timeout: float = 3.0) -> None:
    """Refuse `address` (host:port of a running cluster's GCS, as `ray start --head` prints it, optionally
    `ray://host:port`) when Ray is not installed or nothing accepts a connection there; checked before any work."""
    require("ray", what="--ray")
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise RayAddressError(f"--ray {address}: give the cluster's host:port (as `ray start --head` prints it)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise RayAddressError(f"--ray {address}: cannot be reached ({exc.strerror or exc})") from None


def run_tasks(fn: Callable[[T], R], items: Sequence[T], ray: str | None = None) -> list[R]:
    """fn(item) for every item, in order: here, or as Ray tasks on the cluster at `ray` (one CPU each)."""
    if not ray:
        return [fn(item) for item in items]
    import ray as ray_lib

    ray_lib.init(address=ray, ignore_reinit_error=True, log_to_driver=True, configure_logging=False)
    remote: Any = ray_lib.remote(num_cpus=1)(_call)
    return ray_lib.get([remote.remote(fn, item) for item in items])


def _call(fn: Callable[[T], R], item: T) -> R:
    """A Ray task: fn (any callable, pickled with the task) of one item."""
    return fn(item)
