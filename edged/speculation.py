"""Draft tokens for speculative decoding on the robot: n-gram lookup, no draft model.

A robot's plans repeat what it was told: the scene's names, the skills' names and the JSON
around them, and its own previous plans. The draft for the next tokens is what followed the
most recent earlier occurrence of the context's last ``n`` tokens (``n`` from ``max_ngram``
down to ``min_ngram``), looked up first in the request's own context (prompt and generated tokens), then in
the robot's recent outputs. The generator verifies a draft in one forward and keeps the tokens
its own sampling confirms, so drafts change speed, never output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculationConfig:
    """``[speculation]`` in edged.toml. ``enabled`` false decodes one token per forward."""

    enabled: bool = True
    max_draft: int = 12  # draft tokens verified in one forward, at most
    max_ngram: int = 4  # the longest context suffix looked up
    min_ngram: int = 2  # the shortest (a lone token's followers draft poorly: measured, 10 % slower)
    history_tokens: int = 4096  # the robot's recent outputs kept for lookup

    def __post_init__(self) -> None:
        if self.max_draft < 1 or not 1 <= self.min_ngram <= self.max_ngram or self.history_tokens < 0:
            raise ValueError("speculation: max_draft >= 1, 1 <= min_ngram <= max_ngram, history_tokens >= 0")


class DraftWindow:
    """How many draft tokens the next forward may carry. Every draft token costs a row of the
    forward whether or not it is confirmed, so the window follows what the job's drafts earn:
    after a forward whose drafts were all confirmed it doubles (up to ``limit``); after a
    refusal it is what was confirmed plus one. A plan's repeated text (a step like the one
    before, the JSON between values) gets long drafts, free text short ones."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = limit

    def verified(self, sent: int, confirmed: int) -> None:
        """The last forward carried ``sent`` drafts, of which sampling confirmed the first ``confirmed``."""
        if sent:
            self.size = min(self.limit, 2 * self.size) if confirmed == sent else confirmed + 1


class NgramIndex:
    """A growing token sequence and, per n-gram (``n = 1 .. max_n``), where it last ended.

    Only n-grams that end before the sequence's last token are indexed when looked up, so the
    suffix being matched never finds itself.
    """

    def __init__(self, max_n: int, tokens: Sequence[int] = ()) -> None:
        self.max_n = max_n
        self.tokens: list[int] = list(tokens)
        self._last_end: dict[tuple[int, ...], int] = {}  # n-gram -> index of its last token
        self._indexed = 0  # n-grams ending at indices < this are in _last_end

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)

    def follow(self, suffix: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of ``suffix``
        (a tuple-able n-gram of length <= max_n); [] when it did not occur."""
        self._index_upto(len(self.tokens) - 1)
        end = self._last_end.get(tuple(suffix))
        if end is None:
            return []
        return self.tokens[end + 1:end + 1 + limit]

    def _index_upto(self, stop: int) -> None:
        tokens, last_end = self.tokens, self._last_end
        for end in range(self._indexed, stop):
            for n in range(1, min(self.max_n, end + 1) + 1):
                last_end[tuple(tokens[end - n + 1:end + 1])] = end
        self._indexed = max(self._indexed, stop)


class NgramDrafter:
    """Drafts for one job's context, then from the generator's recent outputs (``history``)."""

    def __init__(self, config: SpeculationConfig, context: Sequence[int], history: NgramIndex) -> None:
        self.config = config
        self.context = NgramIndex(config.max_ngram, context)
        self.history = history

    def accept(self, tokens: Sequence[int]) -> None:
        """The job's context grew by ``tokens`` (sampled, hence final)."""
        self.context.extend(tokens)

    def draft(self, limit: int, after: Sequence[int] = ()) -> list[int]:
        """Up to ``limit`` tokens likely to follow the context and then ``after`` (tokens
        already drafted, e.g. the grammar's forced text): the longest suffix match wins, the
        job's own context before the history at equal length."""
        tail = self.context.tokens[-self.config.max_ngram:] + list(after)
        for n in range(min(self.config.max_ngram, len(tail)), self.config.min_ngram - 1, -1):
            suffix = tail[-n:]
            found = self.context.follow(suffix, limit) or self.history.follow(suffix, limit)
            if found:
                return found
        return []


def recent_outputs(config: SpeculationConfig) -> NgramIndex:
    """An empty history of outputs for ``remember``."""
    return NgramIndex(config.max_ngram)


def remember(history: NgramIndex, output: Sequence[int], config: SpeculationConfig) -> NgramIndex:
    """``history`` with ``output`` appended, trimmed to the newest ``history_tokens`` tokens
    (a trimmed history is a new, re-indexed one)."""
    history.extend(output)
    if len(history.tokens) <= config.history_tokens:
        return history
    tokens = history.tokens
    return NgramIndex(config.max_ngram, tokens[len(tokens) - config.history_tokens:])
