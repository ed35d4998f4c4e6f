"""Draft tokens for speculative decoding on the robot: n-gram lookup, no draft model.

A robot's plans repeat what it was told: the scene's names, the skills' names and the JSON
around them, and its own previous plans. The draft for the next tokens is what followed the
most recent earlier occurrence of the context's last ``n`` tokens (``n`` from ``max_ngram``
down to ``min_ngram``), looked up first in the request's own context (prompt and generated tokens), then in
the robot's recent outputs. The generator verifies a draft in one forward and keeps the tokens
its own sampling confirms, so drafts change speed, never output; how many of them a forward
carries is what pays for their rows (``draft_length``: the backend's measured forward costs,
``ForwardCosts``, against the job's recent confirmations, ``Confirmations``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass


# A token and its drafts stay within the backends' row-exact paths (the CPU decode attention
# kernel's 16 rows, kernels.dense_attention; the block kernel's 32, kernels.ort_ops), where a
# row's logits do not depend on the rows beside it: more would let a draft change a token.
MAX_DRAFT = 15


@dataclass(frozen=True)
class SpeculationConfig:
    """``[speculation]`` in edged.toml. ``enabled`` false decodes one token per forward."""

    enabled: bool = True
    max_draft: int = 12  # draft tokens verified in one forward, at most
    max_ngram: int = 4  # the longest context suffix looked up
    min_ngram: int = 2  # the shortest (a lone token's followers draft poorly: measured, 10 % slower)
    history_tokens: int = 4096  # the robot's recent outputs kept for lookup

    def __post_init__(self) -> None:
        if (not 1 <= self.max_draft <= MAX_DRAFT or not 1 <= self.min_ngram <= self.max_ngram
                or self.history_tokens < 0):
            raise ValueError(f"speculation: 1 <= max_draft <= {MAX_DRAFT}, 1 <= min_ngram <= max_ngram, "
                             "history_tokens >= 0")


class ForwardCosts:
    """A backend's measured seconds per decode forward by its token count (the sampled token and
    its drafts), an exponential average per count. A count not measured yet is read off the
    nearest measured ones: linearly between two, flat beyond them (optimistic about larger
    forwards, which the choice then tries, and so measures)."""

    SMOOTHING = 0.3  # the newest measurement's weight

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}

    def record(self, tokens: int, seconds: float) -> None:
        old = self._seconds.get(tokens)
        self._seconds[tokens] = seconds if old is None else old + self.SMOOTHING * (seconds - old)

    def of(self, tokens: int) -> float | None:
        """The estimated seconds of a forward of ``tokens`` tokens; None before any measurement."""
        known = self._seconds
        if tokens in known or not known:
            return known.get(tokens)
        below = max((n for n in known if n < tokens), default=None)
        above = min((n for n in known if n > tokens), default=None)
        if below is None or above is None:
            return known[above if below is None else below]
        return known[below] + (tokens - below) / (above - below) * (known[above] - known[below])


class Confirmations:
    """A job's recent draft outcomes as ``p``: the chance that a draft token is confirmed when
    the one before it was, estimated as confirmed tokens over confirmed tokens plus refusals,
    each forward's counts weighing twice the previous forward's (a plan alternates runs of
    repeated text, where drafts hold, with free text, where they fail). Starts at 0.5; below
    that, a forward without drafts moves it back towards 0.5, so a job whose drafts stopped
    paying tries again a few tokens later (a model may start copying from its prompt anywhere)."""

    DECAY = 0.5
    PRIOR = 1.0  # pseudo-counts of each kind at the start

    def __init__(self) -> None:
        self.confirmed = self.PRIOR
        self.refused = self.PRIOR

    def verified(self, sent: int, confirmed: int) -> None:
        """The last forward carried ``sent`` drafts, of which sampling confirmed the first ``confirmed``."""
        if sent:
            self.confirmed = self.DECAY * self.confirmed + confirmed
            self.refused = self.DECAY * self.refused + (confirmed < sent)
        elif self.p < 0.5:
            self.confirmed = self.DECAY * self.confirmed + (1 - self.DECAY) * self.PRIOR
            self.refused = self.DECAY * self.refused + (1 - self.DECAY) * self.PRIOR

    @property
    def p(self) -> float:
        return self.confirmed / (self.confirmed + self.refused)


def draft_length(available: int, p: float, costs: ForwardCosts) -> int:
    """How many of ``available`` draft tokens the next forward should carry: the ``L`` with the
    most expected tokens a second, ``(1 + p + ... + p^L) / cost(1 + L)`` (a forward yields its
    sampled token, then each draft while the ones before it hold); all of them while nothing is
    measured. Every draft costs a row whether or not it is confirmed, and what a row costs is the
    backend's: with the block kernel (edged's torch int4, and the int4 ONNX graph's BlockMatMul)
    a little more per token (measured on a 2-core AVX-512 EPYC: 10.6, 14, 18, 24, 32-40 ms for
    1, 2, 4, 8, 13 tokens); with ONNX Runtime's MatMulNBits twice as much for 2 tokens as for
    one (15, 28 ms), so its drafts rarely pay."""
    if costs.of(1) is None:
        return available
    best, best_rate, expected, term = 0, 0.0, 0.0, 1.0
    for length in range(available + 1):
        expected += term
        term *= p
        rate = expected / costs.of(length + 1)
        if rate > best_rate:
            best, best_rate = length, rate
    return best


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


class Spellings:
    """How the model itself spelled text the grammar forced: forced text -> the tokens it chose
    for it, learned from its own outputs (the newest spelling wins; at most ``capacity`` texts,
    the least recently used dropped). Under a grammar a model often splits forced text unlike
    the tokenizer (SmolLM2 writes ``g`` + ``rasp`` where the tokenizer's encoding is ``gr`` +
    ``asp``), and a draft of the tokenizer's split is refused at its first token."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._tokens: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tokens)

    def items(self) -> list[tuple[str, tuple[int, ...]]]:
        """(text, tokens) for every spelling kept, least recently used first."""
        return list(self._tokens.items())

    def get(self, text: str) -> list[int] | None:
        tokens = self._tokens.get(text)
        if tokens is None:
            return None
        self._tokens.move_to_end(text)
        return list(tokens)

    def learn(self, text: str, tokens: Sequence[int]) -> None:
        self._tokens[text] = tuple(tokens)
        self._tokens.move_to_end(text)
        if len(self._tokens) > self.capacity:
            self._tokens.popitem(last=False)


class SpellingWatch:
    """One job's forced texts waiting for the tokens that will spell them: ``expect`` where the
    grammar forces text next, ``observe`` the job's tokens as they grow; each text, once the
    fewest tokens that cover it are there, goes into ``spellings`` with them (their last token
    may run past it, as the model wrote it then), or is dropped where their text differs (a
    tokenizer whose decoded slices are not the text they spell). The generator observes before
    each draft and when the job ends; texts its tokens never covered are not learned."""

    def __init__(self, spellings: Spellings, decode: Callable[[Sequence[int]], str]) -> None:
        self.spellings = spellings
        self.decode = decode
        self._pending: list[tuple[int, str]] = []  # (index of the text's first token in the job's output, text)

    def expect(self, at: int, text: str) -> None:
        """``text`` is forced from the job's output token ``at`` on."""
        if not any(pending == (at, text) for pending in self._pending):
            self._pending.append((at, text))

    def observe(self, output: Sequence[int]) -> None:
        waiting = []
        for at, text in self._pending:
            spelled = self._spelling(output, at, text)
            if spelled is None:
                waiting.append((at, text))
            elif spelled:
                self.spellings.learn(text, spelled)
        self._pending = waiting

    def _spelling(self, output: Sequence[int], at: int, text: str) -> list[int] | None:
        """The fewest tokens from ``at`` whose text starts with ``text``; [] where their text
        covers it and differs; None while it does not cover it yet."""
        for end in range(at + 1, len(output) + 1):
            spelled = self.decode(output[at:end])
            if len(spelled) >= len(text) and not spelled.endswith("\ufffd"):  # not inside a character
                return list(output[at:end]) if spelled.startswith(text) else []
        return None


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
