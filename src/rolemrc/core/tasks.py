"""Independent tasks (a calibration's seeds), run one after another in this process, or as tasks on an existing Ray
cluster (`--ray ADDRESS`, the `ray` extra). Every task reads and writes the same folders, so a cluster needs them on
a filesystem its nodes share; a task's stages are cached there, so a rerun resumes either way."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from rolemrc.core.errors import RolemrcError
from rolemrc.core.extras import require

T = TypeVar("T")
R = TypeVar("R")


class RayAddressError(RolemrcError, ValueError):
    """A `--ray` address that is not host:port or that nothing answers on."""


# HTTP/2's client preface and an empty SETTINGS frame: a Ray cluster's GCS is a gRPC server, which answers them with
# a SETTINGS frame of its own (frame type 4); anything else listening there does not
HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
SETTINGS_FRAME = 4


def check_ray(address: str, timeout: float = 3.0, answer_timeout: float = 20.0) -> None:
    """Refuse `address` (host:port of a running cluster's GCS, as `ray start --head` prints it, optionally
    `ray://host:port`) when Ray is not installed, nothing accepts a connection there, or what does is no gRPC server
    (`ray.init` would retry it for minutes) or no GCS (asked for its cluster id, it gives none within
    `answer_timeout` s; a GCS does in about one); checked before any work."""
    require("ray", what="--ray")
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise RayAddressError(f"--ray {address}: give the cluster's host:port (as `ray start --head` prints it)")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as conn:
            conn.sendall(HTTP2_HELLO)
            head = conn.recv(9)
    except TimeoutError:
        head = b""
    except OSError as exc:
        raise RayAddressError(f"--ray {address}: cannot be reached ({exc.strerror or exc})") from None
    if len(head) < 4 or head[3] != SETTINGS_FRAME:
        raise RayAddressError(f"--ray {address}: something answers there, but not a Ray cluster (no gRPC server; "
                              "give the GCS address `ray start --head` prints)")
    if not address.startswith("ray://"):   # Ray Client's server (ray://) is no GCS: its handshake is all we check
        ask_gcs(address, answer_timeout)


def ask_gcs(address: str, answer_timeout: float) -> None:
    """Refuse a gRPC server that is no Ray GCS (a proxy answering 404): ask it for its cluster id, in a process of
    its own, as Ray's client logs each failed try to stderr and retries for minutes."""
    ask = f"from ray._raylet import GcsClient; GcsClient(address={address!r}).cluster_id"
    try:
        done = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, timeout=answer_timeout)
    except subprocess.TimeoutExpired:
        why = f"no answer in {answer_timeout:g} s"
    else:
        if not done.returncode:
            return
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    raise RayAddressError(f"--ray {address}: no Ray cluster answers there ({why})")


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
