"""Start the real `rolemrc serve` in a subprocess on a free loopback port (tests, notebooks, the demo).

    with running_server({"models": {"tiny": {"path": "runs/dpo"}}}) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml


def die_with_parent() -> None:
    """In a child, before exec: ask Linux to SIGTERM it when its parent dies (no-op elsewhere), so a server
    started for a job that is killed does not outlive it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    """A running server process: `base_url` (no /v1), its config path and its log file."""

    proc: subprocess.Popen
    port: int
    config: Path
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout)


def launch_server(config: dict[str, Any] | str | os.PathLike, *, env: dict[str, str] | None = None,
                  workdir: str | os.PathLike | None = None, port: int | None = None) -> Server:
    """Launch `python -m rolemrc.serve` without waiting for it; it gets SIGTERM (and drains) if the calling
    thread's process dies, so call it from a thread that outlives the server."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="rolemrc-serve-"))
    if isinstance(config, dict):
        path = workdir / "serve.yaml"
        path.write_text(yaml.safe_dump(config))
    else:
        path = Path(config)
    # the port is bound here and handed over: the server listens on it once its engines are up, and until then
    # nothing else (another launch, an engine's own sockets) can be given it
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port or 0))
        port = sock.getsockname()[1]
        log = workdir / f"server-{port}.log"
        with open(log, "ab") as sink:
            proc = subprocess.Popen([sys.executable, "-m", "rolemrc.serve", "--config", str(path), "--port", str(port),
                                     "--socket-fd", str(sock.fileno())], pass_fds=[sock.fileno()],
                                    stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                    preexec_fn=die_with_parent)
    return Server(proc, port, path, log)


def start_server(config: dict[str, Any] | str | os.PathLike, *, env: dict[str, str] | None = None,
                 workdir: str | os.PathLike | None = None, port: int | None = None, timeout: float = 120) -> Server:
    """`launch_server`, then wait for /health; raises with the server's log if it does not come up. One client polls
    (a bare `httpx.get` builds an SSL context per call: ~40 ms of CPU, every 0.2 s of a vLLM start's minute)."""
    server = launch_server(config, env=env, workdir=workdir, port=port)
    proc = server.proc
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.logs()[-4000:]}")
            try:
                if http.get(f"{server.base_url}/health").status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not become healthy in {timeout} s:\n{server.logs()[-4000:]}")


def stop_server(server: Server, timeout: float = 30) -> None:
    if server.proc.poll() is None:
        server.signal(signal.SIGTERM)
        try:
            server.wait(timeout)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.wait(10)


@contextmanager
def running_server(config: dict[str, Any] | str | os.PathLike, **kw: Any):
    """Context manager around start_server/stop_server; yields the Server."""
    server = start_server(config, **kw)
    try:
        yield server
    finally:
        stop_server(server)
