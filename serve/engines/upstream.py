"""The `upstream` engine: any OpenAI-compatible base URL, proxied. `OpenAIProxy` (the relay) is shared with the
`vllm` engine."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import httpx

from rolemrc.serve.engines.base import Capabilities, Final, Generation, Prompt, Resolved, SamplingParams
from rolemrc.serve.errors import ApiError


@dataclass
class UpstreamOptions:
    base_url: str
    upstream_model: str | None = None   # the model id the upstream knows (default: this entry's name)
    api_key_env: str | None = None      # env var holding the upstream's key
    pass_restraints: bool = False       # forward `restraint` (the upstream is a rolemrc server)


class OpenAIProxy:
    """Forwards each request as a streaming call and relays the deltas; closing the generation
    closes the upstream connection (which cancels it there)."""

    kind: ClassVar[str]
    capabilities = Capabilities()

    def __init__(self, name: str, *, base_url: str | None, model_id: str, api_key_env: str | None,
                 pass_restraints: bool, max_queue: int) -> None:
        self.name, self.base_url, self.model_id = name, base_url, model_id
        self.api_key_env, self.pass_restraints = api_key_env, pass_restraints
        self.max_queue = max_queue
        self.admitted = 0
        self.running: dict[str, int] = {}
        self.client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = httpx.AsyncClient(base_url=self.base_url.rstrip("/") + "/", headers=headers,
                                        timeout=httpx.Timeout(None, connect=10))

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    def queue_depth(self) -> dict[str, int]:
        return {}

    def check_restraint(self, restraint: Any) -> None:
        if not self.pass_restraints:
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
            gen.push(Final(reason or "stop", int(usage.get("prompt_tokens", 0)),
                           int(usage.get("completion_tokens", 0))))
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


class UpstreamEngine(OpenAIProxy):
    """An OpenAI-compatible server at `base_url`."""

    kind = "upstream"
    Options = UpstreamOptions

    def __init__(self, name: str, options: UpstreamOptions, *, max_queue: int, **_: Any) -> None:
        super().__init__(name, base_url=options.base_url, model_id=options.upstream_model or name,
                         api_key_env=options.api_key_env, pass_restraints=options.pass_restraints, max_queue=max_queue)
