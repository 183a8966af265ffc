"""`generate.sampling.TextStream` against the naive stream it replaced (every token: decode all ids, search the whole
text for each stop, test every prefix of every stop): the same deltas and stops on random token streams whose stops
cross token boundaries and whose characters span tokens; and the ids it decodes per token stay few as the text grows."""

import random
from typing import ClassVar

import pytest

from rolemrc.generate.sampling import StopTail, TextStream


class NaiveStream:
    """The quadratic reference: what TextStream released before it was made incremental."""

    def __init__(self, tokenizer, stops):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.ids, self.text, self.emitted, self.stopped = [], "", 0, False

    def _decode(self):
        return self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token):
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

    def flush(self):
        if not self.stopped:
            self.text = self._decode()
        return self._release(len(self.text))

    def _release(self, upto):
        delta = self.text[self.emitted:upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return delta


class PieceTok:
    """Tokens that are byte strings: whole characters, halves of multi-byte ones, stray continuation bytes."""

    PIECES: ClassVar[list[bytes]] = [b"a", b"b", b"E", b"N", b"D", b"EN", b"ND", b"aa", b"ab", b" ", b"\xe2\x82",
                                     b"\xac", b"\xe2\x82\xac", b"\xc3", b"\xa9", b"\xc3\xa9", b"\x80", b"\xf0\x9f", b"\x98\x80", b"\xf0\x9f\x98\x80", b"\n"]

    def decode(self, ids, **_):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")


def run(stream, tokens):
    out = []
    for token in tokens:
        delta, stopped = stream.add(token)
        out.append(delta)
        if stopped:
            return out, True
    return [*out, stream.flush()], False


STOPS = [["END"], ["aab", "ND"], ["€a", "é"], ["ababa", "aba"], ["😀\n", "b €"], ["ENEN", "NEN", "a"], []]


@pytest.mark.parametrize("stops", STOPS)
def test_same_deltas_as_the_naive_stream_on_random_pieces(stops):
    rng = random.Random(hash(tuple(stops)) % 1000)
    tok = PieceTok()
    for _ in range(300):
        tokens = [rng.randrange(len(PieceTok.PIECES)) for _ in range(rng.randrange(1, 40))]
        assert run(TextStream(tok, stops), tokens) == run(NaiveStream(tok, stops), tokens), (tokens, stops)


def test_same_deltas_with_the_fixture_tokenizer(tokenizer):
    """A trained byte-level BPE: merges, multi-byte characters split over tokens, special tokens skipped."""
    rng = random.Random(7)
    vocab = len(tokenizer)
    stops = ["the ", "é", "ing", "\n\n", "s t"]
    for _ in range(150):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        for k in range(1, len(stops) + 1):
            chosen = stops[:k]
            assert run(TextStream(tokenizer, chosen), tokens) == run(NaiveStream(tokenizer, chosen), tokens)
    text = "naïve café — 😀 the king's ring"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert "".join(run(TextStream(tokenizer, ["zzz"]), ids)[0]) == tokenizer.decode(ids)
    assert run(TextStream(tokenizer, ["king"]), ids) == run(NaiveStream(tokenizer, ["king"]), ids)


def test_stop_tail_is_the_longest_stop_prefix_the_text_ends_with():
    rng = random.Random(3)
    for _ in range(200):
        stop = "".join(rng.choice("ab") for _ in range(rng.randrange(1, 7)))
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 30)))
        if stop in text:
            continue
        tail = StopTail(stop)
        cut = rng.randrange(len(text) + 1)
        tail.feed(text[:cut])
        assert tail.feed(text[cut:]) == max((k for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)


class CountingByteTok:
    """Bytes as tokens, counting the ids each decode reads."""

    def __init__(self):
        self.decoded = 0

    def decode(self, ids, **_):
        self.decoded += len(ids)
        return bytes(ids).decode("utf-8", errors="replace")


def work_per_token(stream_class, chars, stops):
    """Ids decoded per token over 200 tokens added after `chars` characters: the decode is what grew with the text
    (the stop search is bounded by construction: `find` starts len(stop) - 1 characters back, the tails see only the
    new text)."""
    tok = CountingByteTok()
    stream = stream_class(tok, stops)
    for b in b"ab" * (chars // 2):
        stream.add(b)
    tok.decoded = 0
    for b in b"ab" * 100:
        stream.add(b)
    return tok.decoded / 200


def test_work_per_token_does_not_grow_with_the_text():
    """Counted, not timed: TextStream decodes the same few ids per token at 32k characters as at 1k; the naive
    stream decodes the whole text (checked too, so the count can tell)."""
    stops = ["x" * 255 + "y", "zq", "€€€", "abcabd"]
    assert work_per_token(TextStream, 32000, stops) == work_per_token(TextStream, 1000, stops) <= 4
    assert work_per_token(NaiveStream, 32000, stops) > 30 * work_per_token(NaiveStream, 1000, stops) / 2
