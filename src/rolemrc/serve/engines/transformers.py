"""The `transformers` engine runs in-process over a local HF directory: one scheduler thread batches
concurrent requests whatever their restraints (each row carries its own as per-row runtime multipliers,
`intervene.runtime.RowScales`), decodes token by token over a shared KV cache (so streaming and cancellation
are per step), lets arrivals join a running batch in order and drops finished or cancelled rows."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from rolemrc.core.errors import InputError
from rolemrc.core.placement import DeviceMap, Dtype, check_placement
from rolemrc.intervene.fit import validate
from rolemrc.intervene.runtime import RowScales
from rolemrc.intervene.spec import Restraint
from rolemrc.serve.batch import Batch
from rolemrc.serve.engines.base import (
    MODEL_DIR,
    Capabilities,
    Final,
    Generation,
    Piece,
    Prompt,
    Resolved,
    SamplingParams,
    TokenLogprob,
    check_token_ids,
)
from rolemrc.serve.errors import ApiError, ServeConfigError
from rolemrc.serve.sampling import TextStream, choose, make_generator

log = logging.getLogger("rolemrc.serve")


@dataclass
class TransformersOptions:
    """`path`: a model (a local HF directory, a pulled model's name or a hub id); `dtype` auto: the checkpoint's own;
    `device` auto: a GPU when there is one; `device_map`: the layers placed over the GPUs instead."""

    path: str = field(metadata=MODEL_DIR)
    dtype: Dtype = "auto"
    device: str = "auto"
    device_map: DeviceMap | None = None

    def __post_init__(self) -> None:
        try:
            check_placement(self.device, self.device_map)
        except InputError as exc:
            raise ServeConfigError(str(exc)) from None


@dataclass
class Sequence:
    """Scheduler-side state of one request."""

    gen: Generation
    prompt: list[int]
    params: SamplingParams
    resolved: Resolved
    max_tokens: int
    stream: TextStream
    generator: torch.Generator | None
    out: list[int] = field(default_factory=list)
    pending: list[TokenLogprob] = field(default_factory=list)   # log-probabilities of tokens whose text is held


class TransformersEngine:
    """In-process engine over a local HF directory; applies restraints as runtime hooks."""

    kind = "transformers"
    Options = TransformersOptions
    capabilities = Capabilities(runtime_restraints=True, logprobs=True)

    def __init__(self, name: str, options: TransformersOptions, *, max_batch: int, max_queue: int,
                 default_max_tokens: int) -> None:
        from transformers.utils import logging as hf_logging

        from rolemrc.core.modeling import context_window, load_model

        hf_logging.disable_progress_bar()
        self.name = name
        self.model, self.tokenizer = load_model(options.path, dtype=options.dtype, device=options.device,
                                               device_map=options.device_map)
        self.context_window = int(context_window(self.model, self.tokenizer, default=2048))
        eos = {self.tokenizer.eos_token_id, *_as_list(getattr(self.model.generation_config, "eos_token_id", None))}
        self.eos_ids = torch.tensor(sorted(e for e in eos if e is not None), dtype=torch.long)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else int(self.eos_ids[0])
        self.max_batch, self.max_queue, self.default_max_tokens = max_batch, max_queue, default_max_tokens
        self.admitted = 0
        self.running: Counter[str] = Counter()
        self._waiting: deque[Sequence] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._token_text: dict[int, str] = {}
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)

    async def start(self) -> None:
        self._thread.start()

    async def stop(self) -> None:
        with self._cv:
            self._stopping = True
            for seq in self._waiting:
                seq.gen.push(ApiError(503, "the server is shutting down", code="shutting_down"))
            self._waiting.clear()
            self._cv.notify_all()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 30)

    def queue_depth(self) -> Counter[str]:
        """Waiting requests per restraint label."""
        with self._cv:
            return Counter(seq.resolved.label for seq in self._waiting)

    def check_restraint(self, restraint: Restraint) -> None:
        validate(restraint, self.model)

    def encode(self, prompt: Prompt) -> list[int]:
        from rolemrc.core.chat import render_chat

        if prompt.token_ids is not None:
            check_token_ids(prompt.token_ids, self.model.get_input_embeddings().num_embeddings)
            return prompt.token_ids
        text = render_chat(self.tokenizer, prompt.messages) if prompt.messages is not None else prompt.text
        return self.tokenizer(text, add_special_tokens=prompt.messages is None)["input_ids"]

    async def submit(self, prompt: Prompt, params: SamplingParams, resolved: Resolved) -> Generation:
        """Admit a request (400 when it cannot fit the context window, 429 when the queue is full)."""
        ids = self.encode(prompt)
        room = self.context_window - len(ids)
        if room < 1:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context window is "
                                f"{self.context_window}", code="context_length_exceeded",
                           param="messages" if prompt.messages is not None else "prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else min(self.default_max_tokens, room)
        if max_tokens > room:
            raise ApiError(400, f"max_tokens {max_tokens} + prompt {len(ids)} tokens exceeds the context window "
                                f"of {self.context_window}", code="context_length_exceeded", param="max_tokens")
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        with self._cv:
            if self._stopping:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            if self.admitted >= self.max_queue:
                raise ApiError(429, f"the queue of {self.name!r} is full ({self.max_queue} requests); retry later",
                               code="queue_full")
            self.admitted += 1
            gen = Generation(len(ids), self._release)
            if params.echo:   # the prompt as sent; token ids decoded, as vLLM does
                gen.push(Piece(prompt.text if prompt.text is not None
                               else self.tokenizer.decode(ids, clean_up_tokenization_spaces=False)))
            self._waiting.append(Sequence(gen, ids, params, resolved, max_tokens,
                                          TextStream(self.tokenizer, params.stop), make_generator(params.seed)))
            self._cv.notify()
        return gen

    def _release(self) -> None:
        with self._cv:
            self.admitted -= 1

    # scheduler thread -------------------------------------------------------------------------

    def _take(self, room: int, block: bool) -> list[Sequence]:
        """Up to `room` waiting requests, oldest first, whatever their restraints (block: wait for one)."""
        with self._cv:
            while block and not self._waiting and not self._stopping:
                self._cv.wait()
            waiting = [s for s in self._waiting if not s.gen.cancelled]
            for seq in self._waiting:
                if seq.gen.cancelled:
                    seq.gen.push(Final("cancelled", len(seq.prompt), 0))
            if not waiting:
                self._waiting.clear()
                return []
            self._waiting = deque(waiting[room:])
            return waiting[:room]

    def _run(self) -> None:
        while not self._stopping:
            group = self._take(self.max_batch, block=True)
            if not group:
                continue
            try:
                with torch.inference_mode():
                    self._run_group(group)
            except Exception as exc:  # a failed forward must not take the server down
                log.exception("generation failed")
                for seq in group:
                    seq.gen.push(ApiError(500, f"generation failed: {type(exc).__name__}: {exc}"))

    def _run_group(self, seqs: list[Sequence]) -> None:
        batch, logits = self._prefill(seqs)
        self.running.update(s.resolved.label for s in seqs)
        try:
            while seqs:
                tokens = choose(logits, torch.tensor([s.params.temperature for s in seqs]),
                                torch.tensor([s.params.top_p for s in seqs]), [s.generator for s in seqs])
                done = self._advance(seqs, tokens, self._step_logprobs(seqs, logits, tokens))
                keep = [i for i in range(len(seqs)) if i not in done]
                if done:
                    self.running.subtract(seqs[i].resolved.label for i in done)
                    batch.select(keep)
                    seqs, tokens = [seqs[i] for i in keep], tokens[keep]
                joiners = self._take(self.max_batch - len(seqs), block=False) if batch.can_merge() else []
                if seqs:
                    logits = batch.step(self.model, tokens)
                if joiners:
                    self.running.update(s.resolved.label for s in joiners)
                    extra, extra_logits = self._prefill(joiners)
                    if seqs:
                        batch.merge(extra)
                        logits = torch.cat([logits, extra_logits])
                    else:
                        batch, logits = extra, extra_logits
                    seqs = seqs + joiners
        finally:
            self.running.subtract(s.resolved.label for s in seqs)

    def _prefill(self, seqs: list[Sequence]) -> tuple[Batch, torch.Tensor]:
        """Prefill `seqs`; pushes the prompt log-probabilities of those that asked (`echo` with `logprobs`)
        from the same forward. Returns the batch and the last-position logits [B, V]."""
        rows = [i for i, s in enumerate(seqs) if s.params.prompt_logprobs]
        scales = RowScales.of(self.model, [s.resolved.restraint for s in seqs], checked=True)
        batch, logits = Batch.prefill(self.model, [s.prompt for s in seqs], self.pad_id, scales, every_position=bool(rows))
        if not rows:
            return batch, logits
        width = logits.shape[1]
        targets = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        valid = torch.zeros((len(rows), width), dtype=torch.bool)
        for r, i in enumerate(rows):
            prompt = seqs[i].prompt
            targets[r, width - len(prompt):] = torch.tensor(prompt)
            valid[r, width - len(prompt) + 1:] = True   # a token is scored by the logits one position before it
        index = torch.tensor(rows, device=logits.device)
        scored = self._score(logits[index, :-1][valid[:, 1:].to(logits.device)], targets[:, 1:][valid[:, 1:]],
                             max(seqs[i].params.logprobs for i in rows))
        start = 0
        for i in rows:
            seq, n = seqs[i], len(seqs[i].prompt) - 1
            first = TokenLogprob(self._text(seq.prompt[0]), None, [])
            seq.gen.push(Piece("", [first, *self._entries(seq.prompt[1:], scored, start, seq.params.logprobs)]))
            start += n
        return batch, logits[:, -1]

    def _step_logprobs(self, seqs: list[Sequence], logits: torch.Tensor,
                       tokens: torch.Tensor) -> list[TokenLogprob | None]:
        """Each chosen token's log-probability, for the rows that asked (None for the others)."""
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        out: list[TokenLogprob | None] = [None] * len(seqs)
        if not rows:
            return out
        index = torch.tensor(rows, device=logits.device)
        ids = tokens[index].tolist()
        scored = self._score(logits[index], tokens[index], max(seqs[i].params.logprobs for i in rows))
        for r, i in enumerate(rows):
            out[i] = self._entries(ids[r:r + 1], scored, r, seqs[i].params.logprobs)[0]
        return out

    @staticmethod
    def _score(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[list, list, list]:
        """Log-probabilities of `targets` [N] under `logits` [N, V] and the top `k` per row, as lists: one
        log_softmax and one topk on the model's device. The distribution is the model's own (log-softmax
        of the raw logits, temperature 1, before top-p), which is what OpenAI reports; it is the same for
        greedy and sampled requests and shows a restraint's effect directly."""
        logp = logits.float().log_softmax(-1)
        chosen = logp.gather(1, targets.to(logp.device)[:, None])[:, 0]
        top = logp.topk(k, dim=-1)
        return chosen.tolist(), top.values.tolist(), top.indices.tolist()

    def _entries(self, ids: list[int], scored: tuple[list, list, list], start: int, k: int) -> list[TokenLogprob]:
        """TokenLogprobs for `ids`, read from rows start.. of `scored`, keeping each row's top `k`."""
        chosen, values, indices = scored
        return [TokenLogprob(self._text(t), chosen[start + j],
                             [(self._text(a), v) for a, v in zip(indices[start + j][:k], values[start + j][:k])])
                for j, t in enumerate(ids)]

    def _text(self, token: int) -> str:
        """One token's text on its own (cached)."""
        if token not in self._token_text:
            self._token_text[token] = self.tokenizer.decode([token], clean_up_tokenization_spaces=False)
        return self._token_text[token]

    def _advance(self, seqs: list[Sequence], tokens: torch.Tensor, logprobs: list[TokenLogprob | None]) -> set[int]:
        """Record each row's new token, emit text (with the log-probabilities of the tokens it came from),
        and return the rows that finished. A final EOS counts as generated and keeps its log-probability
        entry, but adds no text (as vLLM)."""
        done: set[int] = set()
        is_eos = torch.isin(tokens.cpu(), self.eos_ids).tolist()
        for i, (seq, token) in enumerate(zip(seqs, tokens.tolist())):
            if seq.gen.cancelled:
                log.info("cancelled", extra={"model": self.name, "completion_tokens": len(seq.out),
                                             "max_tokens": seq.max_tokens})
                seq.gen.push(Final("cancelled", len(seq.prompt), len(seq.out)))
                done.add(i)
                continue
            reason = None
            seq.out.append(token)
            if logprobs[i] is not None:
                seq.pending.append(logprobs[i])
            if is_eos[i] and not seq.params.ignore_eos:
                reason = "stop"
            else:
                delta, stopped = seq.stream.add(token)
                if delta:
                    seq.gen.push(Piece(delta, seq.pending))
                    seq.pending = []
                if stopped:
                    reason = "stop"
                elif len(seq.out) >= seq.max_tokens:
                    reason = "length"
            if reason:
                seq.gen.push(Piece(seq.stream.flush(), seq.pending))
                seq.gen.push(Final(reason, len(seq.prompt), len(seq.out)))
                done.add(i)
        return done


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
