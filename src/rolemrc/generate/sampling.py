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
    """Decoded text of generated ids, released in deltas that never split a stop string or a
    multi-byte character; `add` reports when a stop string was reached (the text ends before it)."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token: int) -> tuple[str, bool]:
        """Append a token; returns (new text safe to send, stopped)."""
        self.ids.append(token)
        text = self._decode()
        if text.endswith("\ufffd"):
            return "", False
        self.text = text
        hits = [pos for pos in (text.find(s) for s in self.stops) if pos != -1]
        if hits:
            self.text, self.stopped = text[:min(hits)], True
            return self._release(len(self.text)), True
        hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._release(len(text) - hold), False

    def flush(self) -> str:
        """The held-back rest at the end of generation (an unfinished character decodes as U+FFFD)."""
        if not self.stopped:
            self.text = self._decode()
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        delta = self.text[self.emitted:upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return delta
