"""The `upstream` engine: any OpenAI-compatible base URL, proxied. `OpenAIProxy` (the relay, and the supervision of
an upstream the engine runs itself) is shared with the `vllm` engine."""

from __future__ import annotations

import asyncio
import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import httpx

from rolemrc.serve.engines.base import (
    Capabilities,
    ClientRestraint,
    Final,
    Generation,
    Piece,
    Prompt,
    Resolved,
    SamplingParams,
    TokenLogprob,
)
from rolemrc.serve.engines.supervisor import EngineState, RestartPolicy, Supervisor
from rolemrc.serve.errors import ApiError

# An idle pooled connection is dropped before the upstream would close it: uvicorn (vLLM's server) closes idle
# keep-alive connections after 5 s, and a request sent on one as the server's FIN crosses it fails with an empty
# httpx.ReadError. httpx's own default expiry is the same 5 s, which lets that race happen.
KEEPALIVE_EXPIRY_S = 2.0


def upstream_client(base_url: str, headers: dict[str, str]) -> httpx.AsyncClient:
    """The HTTP client for one upstream: no read timeout (a generation takes what it takes), a 10 s connect timeout,
    idle connections kept KEEPALIVE_EXPIRY_S."""
    return httpx.AsyncClient(base_url=base_url.rstrip("/") + "/", headers=headers, timeout=httpx.Timeout(None, connect=10),
                             limits=httpx.Limits(max_connections=100, max_keepalive_connections=20,
                                                 keepalive_expiry=KEEPALIVE_EXPIRY_S))


@dataclass
class UpstreamOptions:
    base_url: str
    upstream_model: str | None = None   # the model id the upstream knows (default: this entry's name)
    api_key_env: str | None = None      # env var holding the upstream's key
    pass_restraints: bool = False       # forward `restraint` (the upstream is a rolemrc server)


class OpenAIProxy:
    """Forwards each request as a streaming call and relays the deltas; closing the generation
    closes the upstream connection (which cancels it there).

    An engine that runs its upstream itself (`policy` set) supplies `launch` (start it, set `base_url`),
    `terminate`, `probe` and `restore`; a `Supervisor` then restarts it when it dies (see supervisor.py)."""

    kind: ClassVar[str]
    capabilities = Capabilities(logprobs=True, structured_outputs=True)

    def __init__(self, name: str, *, base_url: str | None, model_id: str, api_key_env: str | None,
                 pass_restraints: bool, max_queue: int, policy: RestartPolicy | None = None) -> None:
        self.name, self.base_url, self.model_id = name, base_url, model_id
        self.api_key_env, self.pass_restraints = api_key_env, pass_restraints
        self.max_queue = max_queue
        self.admitted = 0
        self.running: dict[str, int] = {}
        self.client: httpx.AsyncClient | None = None
        self.policy = policy
        self.supervisor: Supervisor | None = None
        self.on_dead: Callable[[str, str], None] | None = None   # told when the supervisor gives up

    async def start(self) -> None:
        await self.launch()
        self.connect()
        if self.policy is not None:
            self.supervisor = Supervisor(self.name, self.policy, self.probe, self._restart, self.on_dead)
            self.supervisor.watch()

    def connect(self) -> None:
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = upstream_client(self.base_url, headers)

    async def stop(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self.client is not None:
            await self.client.aclose()
        await self.terminate(graceful=True)

    async def launch(self) -> None:
        """Start the upstream (engines that run it themselves)."""

    async def terminate(self, graceful: bool) -> None:
        """Stop the upstream (engines that run it themselves): `graceful`, letting it finish its requests."""

    async def probe(self) -> str | None:
        """Why the upstream cannot answer, or None (engines that run it themselves)."""
        return None

    async def restore(self) -> None:
        """After a restart: serve again what was served before it (engines that run it themselves)."""

    async def _restart(self) -> None:
        await self.terminate(graceful=False)
        await self.launch()
        await self.client.aclose()
        self.connect()
        await self.restore()

    def health(self) -> tuple[EngineState, str | None]:
        """ok, restarting or dead, and why."""
        return ("ok", None) if self.supervisor is None else (self.supervisor.state, self.supervisor.reason)

    async def failed(self, error: ApiError) -> ApiError:
        """The error a request whose upstream call failed gets: a supervised engine found down answers 503."""
        return error if self.supervisor is None or error.status < 500 else await self.supervisor.failed(error)

    def where(self) -> str:
        """The upstream as errors name it (not the loopback address of one the engine runs itself)."""
        return f"upstream {self.base_url}" if self.policy is None else f"the {self.kind} engine of {self.name!r}"

    def queue_depth(self) -> dict[str, int]:
        return {}

    def check_restraint(self, restraint: ClientRestraint) -> None:
        if not self.pass_restraints:
            raise ApiError(400, f"model {self.name!r} is served by the {self.kind} engine, which cannot apply "
                                "restraints (serve a baked checkpoint instead)", code="restraint_unsupported",
                           param="restraint")

    async def upstream_model(self, resolved: Resolved) -> str:
        """The model id to ask the upstream for (engines that map restraints to upstream models override it,
        with `unpin` undoing what it holds for the request)."""
        return self.model_id

    def unpin(self, resolved: Resolved) -> None:
        """Called when a request admitted with `resolved` ends."""

    def body(self, prompt: Prompt, params: SamplingParams, resolved: Resolved,
             model: str) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                                "temperature": params.temperature, "top_p": params.top_p}
        for key in ("max_tokens", "seed"):
            if getattr(params, key) is not None:
                body[key] = getattr(params, key)
        if params.stop:
            body["stop"] = params.stop
        if params.ignore_eos:
            body["ignore_eos"] = True
        if params.response_format is not None:
            body["response_format"] = params.response_format
        if resolved.raw is not None and self.pass_restraints:
            body["restraint"] = resolved.raw
        if prompt.messages is not None:
            if params.logprobs is not None:
                body |= {"logprobs": True, "top_logprobs": params.logprobs}
            return "chat/completions", body | {"messages": prompt.messages}
        if params.logprobs is not None:
            body["logprobs"] = params.logprobs
        if params.echo:   # the upstream echoes the prompt (token ids decoded) and, with logprobs, scores it
            body["echo"] = True
        return "completions", body | {"prompt": prompt.text if prompt.token_ids is None else prompt.token_ids}

    async def submit(self, prompt: Prompt, params: SamplingParams, resolved: Resolved) -> Generation:
        if self.supervisor is not None:
            self.supervisor.admit()
        if self.admitted >= self.max_queue:
            raise ApiError(429, f"the queue of {self.name!r} is full ({self.max_queue} requests); retry later",
                           code="queue_full")
        self.admitted += 1
        try:
            model = await self.upstream_model(resolved)
        except BaseException as exc:
            self.admitted -= 1
            raise await self._unreachable(exc) from None
        release = functools.partial(self._release, resolved)   # from here on, every refusal releases the hold
        try:
            path, body = self.body(prompt, params, resolved, model)
            response = await self.client.send(self.client.build_request("POST", path, json=body), stream=True)
        except BaseException as exc:
            release()
            raise await self._unreachable(exc) from None
        if response.status_code != 200:
            release()
            raise await self.failed(await _upstream_error(response))
        holder: dict[str, asyncio.Task] = {}
        gen = Generation(0, release, on_cancel=lambda: holder["task"].cancel())
        holder["task"] = asyncio.create_task(self._relay(response, gen, prompt.messages is not None, params.logprobs))
        return gen

    async def _unreachable(self, exc: BaseException) -> BaseException:
        """What a failure before the upstream answered raises: a broken connection as 502 (503 from a supervised
        engine found down), anything else as it was."""
        if isinstance(exc, httpx.HTTPError):
            return await self.failed(ApiError(502, f"{self.where()} unreachable: {_why(exc)}"))
        return exc

    def _release(self, resolved: Resolved) -> None:
        self.admitted -= 1
        self.unpin(resolved)

    async def _relay(self, response: httpx.Response, gen: Generation, chat: bool, k: int | None) -> None:
        """Relay the upstream's stream as Pieces (with echo, the first carries the prompt's text)."""
        usage, reason, done = None, None, False
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ApiError(502, f"upstream error: {chunk['error'].get('message')}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    text = ((choice.get("delta") or {}).get("content") if chat else choice.get("text")) or ""
                    logprobs = _logprobs(choice.get("logprobs"), chat, k) if k is not None else []
                    if text or logprobs:
                        gen.push(Piece(text, logprobs))
                    reason = choice.get("finish_reason") or reason
            if not done and reason is None:   # the connection closed mid-answer (a killed upstream closes it cleanly)
                raise ApiError(502, "upstream stream ended before its answer did")
            usage = usage or {}
            gen.push(Final(reason or "stop", int(usage.get("prompt_tokens", 0)),
                           int(usage.get("completion_tokens", 0))))
        except asyncio.CancelledError:
            gen.push(Final("cancelled", 0, 0))
        except ApiError as exc:
            gen.push(await self.failed(exc))
        except (httpx.HTTPError, ValueError) as exc:
            gen.push(await self.failed(ApiError(502, f"upstream stream broke: {_why(exc)}")))
        finally:
            await response.aclose()


def _why(exc: Exception) -> str:
    """An httpx error as words: its message, or its kind where it has none (a reset connection says nothing)."""
    return str(exc) or type(exc).__name__


def _logprobs(data: dict | None, chat: bool, k: int) -> list[TokenLogprob]:
    """A chunk's token log-probabilities in either OpenAI shape: chat keeps each token's `k` best alternatives,
    the legacy shape what the upstream sent (the chosen token and the `k` best, as vLLM and OpenAI do)."""
    if not data:
        return []
    if chat:
        return [TokenLogprob(e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e.get("top_logprobs") or []][:k])
                for e in data.get("content") or []]
    return [TokenLogprob(token, logprob, sorted((top or {}).items(), key=lambda kv: -kv[1]))
            for token, logprob, top in zip(data["tokens"], data["token_logprobs"], data["top_logprobs"])]


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
