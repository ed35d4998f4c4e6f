"""No step twice in a row: a skills plan's grammar, tightened per token so that a step identical
to the one before it (same skill, same arguments) cannot be written, unless its skill is
declared ``repeatable``. A small model loops; this is where its loop is cut.

A JSON grammar cannot say "differs from the previous element", so the guard works on the text.
The plan grammar writes compact JSON (``", "`` and ``": "``, arguments in declared order), so a
repeated step is byte for byte the previous one. While the current step's text is a prefix of
the previous step's, every token the grammar allows that keeps following the previous step is
tried on the matcher: if, with the text the grammar then forces, the step would be complete and
identical, the token is banned. So the ban falls on the last free choice (the last differing
argument value, or the skill name when nothing else can differ) and the grammar never reaches a
dead end: when every allowed token would be banned, none is (a repeat is better than no plan).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future

import torch
import xgrammar as xgr

STEPS_OPEN = b'{"steps": ['
SHORT_PREFIX = 4  # tokens that run past the step's end start with at most this many of its last bytes


class TokenBytes:
    """The vocabulary as bytes, indexed for the guard's lookups."""

    def __init__(self, vocab: Sequence[bytes]):
        self.vocab = vocab
        self.by_bytes: dict[bytes, list[int]] = defaultdict(list)
        self.by_prefix: dict[bytes, list[int]] = defaultdict(list)  # the first 1..SHORT_PREFIX bytes
        for token, text in enumerate(vocab):
            if text:
                self.by_bytes[text].append(token)
                for k in range(1, min(SHORT_PREFIX, len(text)) + 1):
                    self.by_prefix[text[:k]].append(token)

    def following(self, rest: bytes) -> Iterable[int]:
        """Tokens whose text continues along ``rest``: a prefix of it, or (``rest`` short) all of
        it and more."""
        for k in range(1, len(rest) + 1):
            yield from self.by_bytes.get(rest[:k], ())
        if len(rest) <= SHORT_PREFIX:
            yield from (t for t in self.by_prefix.get(rest, ()) if len(self.vocab[t]) > len(rest))


class StepRepeatGuard:
    """The guard of one plan grammar: its vocabulary (built on the grammar compiler's thread
    ahead of the grammar itself, so ready by the time the request's first mask is filled) and
    the skills that may repeat."""

    def __init__(self, tokens: Future[TokenBytes], repeatable: frozenset[str]):
        self._tokens = tokens
        self.repeatable = repeatable

    @functools.cached_property
    def tokens(self) -> TokenBytes:
        """The vocabulary, waited for once (a per-token path reads it)."""
        return self._tokens.result()

    def restrict(self, matcher: xgr.GrammarMatcher, text: bytes, mask: torch.Tensor) -> None:
        """Clear, in ``mask`` (one bitmask row, int32 words), the tokens that would write the
        previous step again; ``text`` is everything accepted so far."""
        steps = _split_steps(text)
        if steps is None or len(steps) < 2:
            return
        previous, current = steps[-2], steps[-1]
        if not previous.startswith(current) or _skill_of(previous) in self.repeatable:
            return
        rest = previous[len(current):]
        banned = [t for t in set(self.tokens.following(rest))
                  if _allowed(mask, t) and self._repeats(matcher, current + self.tokens.vocab[t], previous, t)]
        if not banned:
            return
        words = [word & 0xFFFFFFFF for word in mask.tolist()]  # unsigned: bit 31 is a token like the others
        for t in banned:
            words[t >> 5] &= ~(1 << (t & 31))
        if any(words):  # something else stays allowed: never a dead end
            mask.copy_(torch.tensor(words, dtype=torch.int64).to(mask.dtype))

    def _repeats(self, matcher: xgr.GrammarMatcher, written: bytes, previous: bytes, token: int) -> bool:
        """Whether ``token`` (making the step ``written``) leaves only the previous step's text."""
        if len(written) >= len(previous):
            return written.startswith(previous)
        if not matcher.accept_token(token):
            return False
        try:
            forced = matcher.find_jump_forward_string().encode()
        finally:
            matcher.rollback(1)
        return (written + forced).startswith(previous)


def _allowed(mask: torch.Tensor, token: int) -> bool:
    return (int(mask[token >> 5]) >> (token & 31)) & 1 == 1


def _split_steps(text: bytes) -> list[bytes] | None:
    """The steps array's elements so far (the last possibly incomplete, ``b""`` right after a
    separator), or None outside the array: compact JSON, strings scanned with their escapes."""
    if not text.startswith(STEPS_OPEN):
        return None
    steps: list[bytes] = []
    depth, start, in_string, escaped = 0, None, False, False
    for i in range(len(STEPS_OPEN), len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:
                in_string = False
            continue
        if c == 0x22:
            in_string = True
        elif c == 0x7B:  # {
            if depth == 0:
                start = i
            depth += 1
        elif c == 0x7D:  # }
            depth -= 1
            if depth == 0:
                steps.append(text[start:i + 1])
                start = None
        elif c == 0x5D and depth == 0:  # ] closes the array
            return None
    steps.append(text[start:] if start is not None else b"")
    return steps


def _skill_of(step: bytes) -> str:
    """The skill name of a complete step ``{"skill": "<name>", ...``."""
    head = b'{"skill": "'
    return step[len(head):step.index(b'"', len(head))].decode() if step.startswith(head) else ""
