"""Incremental detokenization with stop strings, for streaming text deltas.

Contract: ``push`` returns only text that is final: never half of a multi-byte character, and
never a tail that might still turn out to be the start of a stop string. When a stop string
appears, the text is cut just before it (OpenAI semantics) and ``stopped`` becomes True.

Where the decoder spells every id as fixed bytes (``token_bytes``: a byte-level BPE vocabulary,
``shared.model.tokenizer``) a push appends the new ids' bytes to an incremental UTF-8 decoder,
which holds back an incomplete character by itself: a table lookup per token, ~4x cheaper than a
decode call. Otherwise each push decodes only the new ids with the previous push's ids as
context (vLLM's offsets): the cost per token stays constant instead of re-decoding the whole
output every step, and the context makes a word's leading space and a character split over
tokens come out as they do in a decode of the whole sequence.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol

from shared.engine.request_budget import WorkMeter


class Decoder(Protocol):
    """``decode`` is the text of ids; an optional ``token_bytes`` attribute (a sequence of
    bytes per id, or None) says that this text is always the UTF-8 of the ids' bytes joined,
    invalid bytes replaced by U+FFFD."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """One request's text; ``push`` and ``flush`` charge their time to ``work``, the request's
    meter (``shared.engine.request_budget``)."""

    __slots__ = ("_source", "_stop", "_emitted", "text", "stopped", "work")

    def __init__(self, decoder: Decoder, stop: Sequence[str] = ()):
        self.work = WorkMeter()
        table = getattr(decoder, "token_bytes", None)
        self._source = _ByteStream(table) if table is not None else _DecodeWindow(decoder)
        self._stop = tuple(stop)
        self._emitted = 0  # characters of the decoded text already returned
        self.text = ""  # everything decoded so far (cut at a stop string once stopped)
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly final text."""
        with self.work.timing():
            return self._push(token_ids)

    def _push(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self.text += self._source.decode_new(token_ids, final=False)
        if not self._stop:
            return self._release(len(self.text))
        hit = self._find_stop()
        if hit is not None:
            self.text = self.text[:hit]
            self.stopped = True
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back())

    def flush(self) -> str:
        """At the end of the request: whatever was held back (an incomplete character too)."""
        with self.work.timing():
            if not self.stopped:
                self.text += self._source.decode_new((), final=True)
            return self._release(len(self.text))

    def _find_stop(self) -> int | None:
        window = max((len(s) for s in self._stop), default=0)
        start = max(0, self._emitted - window)
        hits = [i for s in self._stop if (i := self.text.find(s, start)) != -1]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest tail that is a proper prefix of some stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _release(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        delta = self.text[self._emitted : upto]
        self._emitted = upto
        return delta


class _ByteStream:
    """Text from each id's bytes through an incremental UTF-8 decoder, which holds back an
    incomplete character until the rest of it (or ``final``) arrives."""

    __slots__ = ("_table", "_utf8")

    def __init__(self, token_bytes: Sequence[bytes]) -> None:
        self._table = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode_new(self, token_ids: Sequence[int], final: bool) -> str:
        """The text ``token_ids`` complete (an incomplete character at the end only if ``final``)."""
        table = self._table
        try:
            data = b"".join(map(table.__getitem__, token_ids))
        except IndexError:  # ids past the vocabulary (a model's padding rows) read nothing, as in decode
            data = b"".join([table[i] for i in token_ids if i < len(table)])
        return self._utf8.decode(data, final)


class _DecodeWindow:
    """Text from decode calls: the new ids with the previous push's as context."""

    __slots__ = ("_decoder", "_ids", "_prefix_offset", "_read_offset", "_window_taken")

    def __init__(self, decoder: Decoder) -> None:
        self._decoder = decoder
        self._ids: list[int] = []
        self._prefix_offset = 0  # ids[prefix_offset:read_offset]: context decoded again
        self._read_offset = 0  # ids before this are in the text already returned
        self._window_taken = 0  # chars of the pending window (ids past read_offset) already returned

    def decode_new(self, token_ids: Sequence[int], final: bool) -> str:
        """The text ``token_ids`` complete. While the ids end inside a multi-byte character
        (U+FFFD), only what comes before it, and the offsets stay (the next push decodes the
        same window again), unless ``final``."""
        self._ids.extend(token_ids)
        context = self._decoder.decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decoder.decode(self._ids[self._prefix_offset :])[len(context) :]
        if window.endswith("\ufffd") and not final:
            complete = window.rstrip("\ufffd")
            new = complete[self._window_taken :]
            self._window_taken = max(self._window_taken, len(complete))
            return new
        new = window[self._window_taken :]
        self._prefix_offset, self._read_offset, self._window_taken = self._read_offset, len(self._ids), 0
        return new
