"""Choosing tokens and releasing text: batched next-token choice (greedy, temperature, top-p, per-request seeds) and
incremental text with stop strings."""

from __future__ import annotations

from typing import Any

import torch


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator().manual_seed(seed % (2**63))


def choose(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """Next tokens [B] from logits [B, V]: greedy rows take the argmax; the others sample from the
    temperature-scaled, nucleus-filtered distribution with the Gumbel-max trick (seeded rows draw
    their noise from their own generator, so a seed reproduces regardless of batch neighbours)."""
    logits = logits.float()
    greedy = temperature <= 0
    best = logits.argmax(-1)
    if bool(greedy.all()):
        return best
    scaled = logits / temperature.clamp_min(1e-5)[:, None]
    if bool((top_p < 1).any()):
        ordered, order = scaled.sort(-1, descending=True)
        probs = ordered.softmax(-1)
        drop = (probs.cumsum(-1) - probs) > top_p[:, None]   # keeps the smallest prefix reaching top_p
        scaled = torch.empty_like(scaled).scatter_(1, order, ordered.masked_fill(drop, float("-inf")))
    noise = torch.rand(scaled.shape)
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row] = torch.rand(scaled.shape[1], generator=gen)
    gumbel = -torch.log(-torch.log(noise.clamp(1e-12, 1 - 1e-7)))
    return torch.where(greedy, best, (scaled + gumbel.to(scaled.device)).argmax(-1))


class TextStream:
    """Decoded text of generated ids, released in deltas that never split a stop string or a multi-byte character;
    `add` reports when a stop string was reached (the text ends before it). Work per token is linear in its new
    text: only a tail of ids is decoded (vLLM's detokenizer: the ids in [prefix, read) give the context that makes
    the new ids decode as they do in the whole), stops are searched in the new text and the (len(stop) - 1)
    characters before it, and what is held back (the longest stop prefix the text ends with) is tracked by one KMP
    automaton per stop fed the new characters."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.tails = [StopTail(s) for s in self.stops]
        self.ids: list[int] = []
        self.prefix = self.read = 0   # ids[prefix:read] decode to the text just before ids[read:]
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _new_text(self) -> str:
        """The text of ids[read:] (in the context of ids[prefix:read])."""
        return self._decode(self.ids[self.prefix:])[len(self._decode(self.ids[self.prefix:self.read])):]

    def add(self, token: int) -> tuple[str, bool]:
        """Append a token; returns (new text safe to send, stopped)."""
        self.ids.append(token)
        new = self._new_text()
        if new.endswith("\ufffd"):
            return "", False
        self.prefix, self.read = self.read, len(self.ids)
        old = len(self.text)
        self.text += new
        hits = [pos for s in self.stops if (pos := self.text.find(s, max(0, old - len(s) + 1))) != -1]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True
            return self._release(len(self.text)), True
        hold = max([tail.feed(new) for tail in self.tails], default=0)
        return self._release(len(self.text) - hold), False

    def flush(self) -> str:
        """The held-back rest at the end of generation (an unfinished character decodes as U+FFFD)."""
        if not self.stopped:
            self.text += self._new_text()
            self.prefix, self.read = self.read, len(self.ids)
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        delta = self.text[self.emitted:upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return delta


class StopTail:
    """A KMP automaton over one stop string: after `feed`, how long a prefix of the stop the text ends with."""

    def __init__(self, stop: str) -> None:
        self.stop, self.matched = stop, 0
        self.fail = [0] * len(stop)   # fail[i]: the longest proper border of stop[:i + 1]
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k

    def feed(self, text: str) -> int:
        stop, fail, k = self.stop, self.fail, self.matched
        for char in text:
            while k and char != stop[k]:
                k = fail[k - 1]
            if char == stop[k]:
                k += 1
        self.matched = k
        return k
