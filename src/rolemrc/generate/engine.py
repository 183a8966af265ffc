"""The generation engine: continuous batching over a transformers causal LM, each request in a slot holding the KV-cache
pages its prompt and completion need (`cache.PagedCache`).

Each `step` admits waiting requests into free slots as one prefill group (as many, in order, as the cache's pages
hold), runs the group's next prefill chunk (so a
long prompt never stalls the rows that are decoding for more than a chunk), then one decode step for every decoding
row, whatever its restraint. The decode step reads the last tokens and positions from per-slot tensors whose addresses
never change, so on CUDA it replays a captured graph (`graphs.DecodeGraphs`) at a few batch sizes. Single-threaded:
a server drives it from one scheduler thread, the offline API (`offline.generate`) from the caller's.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import torch

from rolemrc.generate.cache import GRAIN, PAGE, PagedCache, attention_mask, mask_layout, pages_for, round_up
from rolemrc.generate.params import Output, Request, TokenLogprob
from rolemrc.generate.prefix import BLOCK, PrefixIndex, block_hashes
from rolemrc.generate.sampling import TextStream, choose, make_generator
from rolemrc.generate.scales import SlotScales

log = logging.getLogger("rolemrc.generate")

PREFILL_TOKENS = 4096   # tokens per prefill forward (a chunk covers PREFILL_TOKENS // rows prompt positions)
SCORED_TOKENS = 512     # ... when the group scores its prompts: every position's logits are kept, one chunk at a time
SCORE_ROWS = 128        # rows of logits `score` turns into log-probabilities at once


@dataclass
class PrefillGroup:
    """Requests admitted together: what is left of their prompts left-padded to one width, each column's cache
    position per row (a row's padding is written after its prompt, where its generated tokens will overwrite it),
    done in chunks."""

    requests: list[Request]
    slots: torch.Tensor
    ids: torch.Tensor         # [rows, width]: each prompt's part not copied from a held prefix
    positions: torch.Tensor   # [rows, width]
    limit: torch.Tensor       # [rows] prompt lengths
    span: int                 # the longest prompt: positions attended over
    done: int = 0             # columns prefilled


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The tokenizer's EOS and the generation config's."""
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    extra = extra if isinstance(extra, (list, tuple)) else [extra]
    return {e for e in (tokenizer.eos_token_id, *extra) if e is not None}


class Engine:
    """Continuous batching for one loaded model, `max_batch` requests at a time."""

    def __init__(self, model: Any, tokenizer: Any, *, max_batch: int = 32, prefill_tokens: int = PREFILL_TOKENS,
                 graphs: bool = True, max_length: int | None = None, kv_positions: int | None = None) -> None:
        """`max_length`: positions one request may hold (prompt + completion); `kv_positions`: positions the cache
        may hold over all requests (its budget); None: unbounded."""
        self.model, self.tokenizer, self.slots = model, tokenizer, max_batch
        self.max_length = max_length
        self.device = model.get_input_embeddings().weight.device
        self.dtype = next(model.parameters()).dtype
        self.eos = torch.tensor(sorted(eos_ids(model, tokenizer)), dtype=torch.long)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(self.eos[0])
        self.prefill_tokens = prefill_tokens
        self.cache = PagedCache(max_batch, kv_positions, max_length, self.device)
        self.scales = SlotScales(model, max_batch)
        self.prefixes = PrefixIndex()
        self.stats: Counter[str] = Counter()   # prompt tokens admitted, and those copied from a held prefix
        self.window, self.per_layer_type = mask_layout(model.config)
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.waiting: deque[Request] = deque()
        self.joining: list[Request] = []   # taken into slots for the next prefill group, not yet in it
        self.group: PrefillGroup | None = None
        self.decoding: dict[int, Request] = {}
        self.free = list(range(max_batch))
        self.tokens = torch.full((max_batch,), self.pad_id, dtype=torch.long, device=self.device)   # next input
        self.next_pos = torch.full((max_batch,), self.cache.parking, dtype=torch.long, device=self.device)   # where it goes
        self.lengths = [0] * max_batch          # positions a decoding slot fills after its next decode step
        self.unlimited = torch.full((max_batch,), 2**62, dtype=torch.long, device=self.device)
        self._token_text: dict[int, str] = {}
        self.graphs = None
        if graphs and self.device.type == "cuda":
            from rolemrc.generate.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self)

    # public ---------------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        need = self._positions(request)
        too_long = self.max_length is not None and need > self.max_length
        if too_long or (self.cache.max_pages is not None and pages_for(need) >= self.cache.max_pages):
            raise ValueError(f"a request of {need} positions can never fit this engine's cache "
                             f"(max_length {self.max_length}, {self.cache.max_pages} pages of {PAGE})")
        request.stream = TextStream(self.tokenizer, request.params.stop) if request.text or request.params.stop else None
        request.generator = make_generator(request.params.seed)
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.group or self.decoding)

    @property
    def running(self) -> list[Request]:
        """Requests holding a slot (joining or in the prefill group, or decoding), each once."""
        return list(dict.fromkeys([*self.joining, *(self.group.requests if self.group else []),
                                   *self.decoding.values()]))

    def step(self) -> None:
        """One round: admit, one prefill chunk, one decode step."""
        self._drop_cancelled()
        if self.group is None and self.waiting and self.free:
            try:
                self._admit()
            except torch.OutOfMemoryError:   # growing the cache for the new group: only that group fails
                self._drop_group("out_of_memory")
        if self.group is not None:
            self._prefill_chunk()
        if self.decoding:
            self._decode()

    def fail(self) -> list[Request]:
        """Free the slot of every request that holds one after a failed step (those joining or in the prefill
        group, and the decoding ones); returns them (the caller reports the error at once)."""
        failed = [r for r in self.running if r.slot >= 0]
        self.joining, self.group = [], None
        for request in failed:
            self.prefixes.drop(request.slot)
            self._free(request)
        self.decoding.clear()
        return failed

    def _drop_group(self, reason: str) -> None:
        """End the requests being admitted (joining, or in the prefill group) with `reason`; the decoding ones go on.
        The cache is as it was (`PagedCache.assign` is all or nothing)."""
        dropped = list(dict.fromkeys([*self.joining, *(self.group.requests if self.group else [])]))
        log.warning("admitting %d request(s) failed: %s", len(dropped), reason)
        self.joining, self.group = [], None
        for request in dropped:
            self.prefixes.drop(request.slot)
            request.emit(Output("", [], reason, 0))
            self._free(request)

    # scheduling -----------------------------------------------------------------------------------

    def _drop_cancelled(self) -> None:
        for request in [r for r in self.waiting if r.cancelled()]:
            self.waiting.remove(request)
            request.emit(Output(finish_reason="cancelled"))
        for slot, request in list(self.decoding.items()):
            if request.cancelled():
                del self.decoding[slot]
                self._finish(request, "cancelled")

    def _admit(self) -> None:
        """Take waiting requests into free slots as one prefill group. A request whose prompt begins like one a
        slot holds (`prefix.PrefixIndex`) starts from those pages, shared; one whose next block another request of
        this group is about to compute waits for the next group, to share it then. A request whose pages do not fit
        waits, first in line, for pages to come free."""
        self.free.sort()
        self.joining = requests = []
        starts, computing, deferred = [], set(), []
        scan = len(self.free) * 4 + 64   # how far down the queue a group looks for requests it can take
        try:
            self._take(requests, starts, computing, deferred, scan)
        finally:
            self.waiting.extendleft(reversed(deferred))
        if requests:
            self.group = self._group(requests, starts)
        self.joining = []

    def _take(self, requests: list[Request], starts: list[int], computing: set[int], deferred: list[Request],
              scan: int) -> None:
        """Move waiting requests into free slots (appending to `requests`, `starts`), deferring those that wait
        for a block the group computes."""
        while self.waiting and self.free and scan:
            scan -= 1
            request = self.waiting.popleft()
            if request.hashes is None:
                key = self.scales.known(request.restraint)[0] if request.restraint is not None else ""
                request.hashes = [] if request.params.prompt_logprobs else block_hashes(
                    key, request.prompt, len(request.prompt) - 1)
            blocks, source = self.prefixes.longest(request.hashes)
            if blocks < len(request.hashes) and request.hashes[blocks] in computing:
                deferred.append(request)
                continue
            slot = source if source in self.free else self.free[0]
            need, shared = self._positions(request), blocks * BLOCK
            if not self._room(slot, need, source, shared):
                self.waiting.appendleft(request)   # first in line: it waits for pages to come free
                break
            self.free.remove(slot)
            request.slot = slot
            requests.append(request)
            if self.cache.assign(slot, need, source, shared):
                self._regrown()
            self.prefixes.hold(slot, request.hashes[:blocks])
            computing.update(request.hashes[blocks:])
            starts.append(blocks * BLOCK)
            self.stats["prompt_tokens"] += len(request.prompt)
            self.stats["prompt_tokens_reused"] += blocks * BLOCK

    def _group(self, requests: list[Request], starts: list[int]) -> PrefillGroup:
        """The prefill group of requests just given slots, their prompts from `starts` on left-padded together."""
        suffixes = [r.prompt[k:] for r, k in zip(requests, starts)]
        width = max(len(x) for x in suffixes)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        now = time.perf_counter()
        for row, (request, suffix) in enumerate(zip(requests, suffixes)):
            request.admitted = now
            ids[row, width - len(suffix):] = torch.tensor(suffix)
            self.scales.assign(request.slot, request.restraint)
        lengths = torch.tensor([len(r.prompt) for r in requests])
        first = torch.tensor(starts)[:, None]
        column, pad = torch.arange(width)[None], (width - torch.tensor([len(x) for x in suffixes]))[:, None]
        room = torch.tensor([max(1, r.max_tokens) for r in requests])[:, None]
        positions = torch.where(column >= pad, first + column - pad, lengths[:, None] + column % room)
        index = torch.tensor([r.slot for r in requests], device=self.device)
        self.next_pos[index] = lengths.to(self.device)   # a prefilling slot's safe write position in decode steps
        return PrefillGroup(requests, index, ids.to(self.device), positions.to(self.device), lengths.to(self.device),
                            pages_for(int(lengths.max())) * PAGE)

    @staticmethod
    def _positions(request: Request) -> int:
        """Positions a request holds: its prompt and its completion (one at least: the slot's padding goes there)."""
        return len(request.prompt) + max(1, request.max_tokens)

    def _room(self, slot: int, need: int, source: int | None, shared: int) -> bool:
        """Whether `slot` can take `need` positions now, dropping prefixes that free slots hold (other than
        `slot`'s and `source`'s) until it can."""
        for other in [s for s in self.free if s not in (slot, source) and self.cache.owned[s]]:
            if not self.cache.short(slot, need, source, shared):
                return True
            self.prefixes.drop(other)
            self.cache.release(other)
        return not self.cache.short(slot, need, source, shared)

    def _regrown(self) -> None:
        """The cache's buffers moved: captured graphs are stale, free slots park again."""
        if self.graphs is not None:
            self.graphs.clear()
        if self.free:
            self.next_pos[torch.tensor(self.free, device=self.device)] = self.cache.parking

    def _prefill_chunk(self) -> None:
        group = self.group
        rows, width = len(group.requests), group.ids.shape[1]
        scored = [i for i, r in enumerate(group.requests) if r.params.prompt_logprobs]
        budget = min(self.prefill_tokens, SCORED_TOKENS) if scored else self.prefill_tokens
        end = min(width, group.done + max(1, budget // rows))
        write = group.positions[:, group.done:end]
        logits = self._forward(group.ids[:, group.done:end], group.slots, write, group.limit, group.span,
                               keep=0 if scored else 1)
        if scored:
            self._prompt_logprobs(group, scored, logits, group.done, end)
        group.done = end
        if end < width:
            return
        last = logits[:, -1]
        for request in group.requests:
            self.lengths[request.slot] = len(request.prompt)
            self.prefixes.hold(request.slot, request.hashes)
        self._advance(group.requests, last, group.slots)
        self.group = None

    def _decode(self) -> None:
        slots = sorted(self.decoding)
        hi = slots[-1] + 1
        # a captured graph per width: few widths on CUDA (GRAIN); eagerly, only the pages the rows hold
        width = round_up(max(self.lengths[s] for s in slots), PAGE if self.graphs is None else GRAIN)
        if self.graphs is not None:
            logits = self.graphs.decode(hi, width)
        else:
            logits = self.decode_forward(hi, width)
        index = torch.tensor(slots, device=self.device)
        self._advance([self.decoding[s] for s in slots], logits[index, -1], index)

    def decode_forward(self, rows: int, width: int) -> torch.Tensor:
        """The decode step over slots [0, rows) (slots not decoding run as padding and are ignored): logits
        [rows, 1, vocab]. Its inputs are `tokens` and `next_pos`, so a graph captured from it replays as is."""
        positions = self.next_pos[:rows, None]
        return self._forward(self.tokens[:rows, None], slice(0, rows), positions, self.unlimited[:rows], width, keep=1)

    def _forward(self, ids: torch.Tensor, rows: slice | torch.Tensor, write: torch.Tensor, limit: torch.Tensor,
                 width: int, keep: int) -> torch.Tensor:
        self.cache.at(rows, write, width)
        self.scales.rows = rows
        mask = attention_mask(write, limit, width, self.dtype)
        if self.window is not None:
            sliding = attention_mask(write, limit, width, self.dtype, self.window)
            mask = {"full_attention": mask, "sliding_attention": sliding} if self.per_layer_type else sliding
        out = self.model(input_ids=ids, position_ids=write, attention_mask=mask, use_cache=True,
                         logits_to_keep=keep, **{self.cache_arg: self.cache})
        return out.logits

    # tokens ---------------------------------------------------------------------------------------

    def _advance(self, requests: list[Request], logits: torch.Tensor, slots: torch.Tensor) -> None:
        """Choose each request's next token from its logits [rows, vocab], emit its text, finish the ones that
        ended and put the others in (or keep them in) the decode batch."""
        params = [r.params for r in requests]
        tokens = choose(logits, torch.tensor([p.temperature for p in params]), torch.tensor([p.top_p for p in params]),
                        [r.generator for r in requests])
        logprobs = self._step_logprobs(requests, logits, tokens)
        self.tokens[slots] = tokens.to(self.device)
        broken = ~torch.isfinite(logits).all(-1)   # NaN/inf logits (e.g. a huge restraint factor): the row fails
        host, broken = torch.stack([tokens.to(broken.device), broken.long()]).cpu()   # one transfer
        broken = broken.tolist()
        staying = []
        for request, token, eos, logprob, bad in zip(requests, host.tolist(), torch.isin(host, self.eos).tolist(),
                                                     logprobs, broken):
            if bad:
                self.decoding.pop(request.slot, None)
                self._finish(request, "error")
                continue
            request.out.append(token)
            if logprob is not None:
                request.pending.append(logprob)
            reason = None
            if eos and not request.params.ignore_eos:
                reason = "stop"
            else:
                delta, stopped = request.stream.add(token) if request.stream else ("", False)
                if delta:
                    request.emit(Output(delta, request.pending))
                    request.pending = []
                if stopped:
                    reason = "stop"
                elif len(request.out) >= request.max_tokens:
                    reason = "length"
            if reason:
                self.decoding.pop(request.slot, None)
                self._finish(request, reason)
            else:
                self.decoding[request.slot] = request
                staying.append(request.slot)
        if staying:   # the chosen token goes into the cache at the next decode step
            index = torch.tensor(staying, device=self.device)
            self.next_pos[index] = torch.tensor([self.lengths[s] for s in staying], device=self.device)
            for s in staying:
                self.lengths[s] += 1

    def _finish(self, request: Request, reason: str) -> None:
        text = request.stream.flush() if request.stream and reason != "cancelled" else ""
        request.emit(Output(text, request.pending, reason, len(request.out)))
        request.pending = []
        self._free(request)

    def _free(self, request: Request) -> None:
        slot, request.slot = request.slot, -1
        self.scales.release(slot)
        self.tokens[slot] = self.pad_id
        self.cache.release(slot, len(self.prefixes.held.get(slot, ())) * BLOCK)   # a held prefix stays
        self.next_pos[slot] = self.cache.parking   # its padding goes to no page of anyone's
        self.lengths[slot] = 0
        self.free.append(slot)

    # log-probabilities ----------------------------------------------------------------------------

    def _step_logprobs(self, requests: list[Request], logits: torch.Tensor,
                       tokens: torch.Tensor) -> list[TokenLogprob | None]:
        """Each chosen token's log-probability, for the requests that asked (None for the others)."""
        rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        out: list[TokenLogprob | None] = [None] * len(requests)
        if not rows:
            return out
        index = torch.tensor(rows, device=logits.device)
        ids = tokens[index.cpu()].tolist()
        scored = score(logits[index], tokens[index.cpu()], max(requests[i].params.logprobs for i in rows))
        for r, i in enumerate(rows):
            out[i] = self._entries(ids[r:r + 1], scored, r, requests[i].params.logprobs)[0]
        return out

    def _prompt_logprobs(self, group: PrefillGroup, rows: list[int], logits: torch.Tensor, start: int,
                         end: int) -> None:
        """Emit the prompt tokens' log-probabilities that columns [start, end) of the group's prefill predict
        (the logits at a column score the next column's token; the prompt's first token has none)."""
        width = group.ids.shape[1]
        for i in rows:
            request = group.requests[i]
            first_col = width - len(request.prompt)
            entries = [TokenLogprob(self._text(request.prompt[0]), None, [])] if start <= first_col < end else []
            lo, hi = max(start, first_col), min(end, width - 1)   # predicting columns lo+1 .. hi
            if hi > lo:
                targets = group.ids[i, lo + 1:hi + 1]
                scored = score(logits[i, lo - start:hi - start], targets, request.params.logprobs)
                entries += self._entries(targets.tolist(), scored, 0, request.params.logprobs)
            if entries:
                request.emit(Output("", entries))

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


def score(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[list, list, list]:
    """Log-probabilities of `targets` [N] under `logits` [N, V] and the top `k` per row, as lists: log_softmax and
    topk on the model's device, `SCORE_ROWS` rows at a time (so no float copy of all N rows is made). The
    distribution is the model's own (log-softmax of the raw logits, temperature 1, before top-p), which is what OpenAI
    reports; it is the same for greedy and sampled requests and shows a restraint's effect directly."""
    chosen: list[float] = []
    values: list[list[float]] = []
    indices: list[list[int]] = []
    for lo in range(0, len(logits), SCORE_ROWS):
        logp = logits[lo:lo + SCORE_ROWS].float().log_softmax(-1)
        chosen += logp.gather(1, targets[lo:lo + SCORE_ROWS].to(logp.device)[:, None])[:, 0].tolist()
        top = logp.topk(k, dim=-1)
        values += top.values.tolist()
        indices += top.indices.tolist()
    return chosen, values, indices
