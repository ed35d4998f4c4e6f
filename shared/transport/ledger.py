"""Idempotency and stream resumption on the daemon side: ``request_id`` -> what it produced.

A retried ``generate`` (same ``request_id``, same content) never runs twice: while the first is
running the retry attaches to it (its sender becomes a subscriber and gets the stream's chunks
from ``resume_from`` on); after it finished the retry gets the same chunks and ``result`` again,
for ``ttl_s`` seconds. A different request under a used id is refused. Entries are dropped
``ttl_s`` after they finish, or oldest-finished first beyond ``max_entries``.

An entry keeps a digest of its request, not the request: a finished entry holds only its
result and, for a stream, its chunks (300 finished requests carrying 0.9 MB of unused tags each
had grown the daemon by 254 MB).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from shared.protocol.messages import Chunk, Error, ErrorCode, Generate, Message, Result
from shared.transport.execution_log import KeptResult


@dataclass
class LedgerEntry:
    """One request's record: who listens, what it streamed, how it ended."""

    fingerprint: bytes  # digest of the request's fingerprint(): what a retry must match
    stream: bool
    robot_id: str  # whose request it is
    subscribers: list[bytes]  # ROUTER identities to send to, oldest first
    chunks: list[Chunk] = field(default_factory=list)  # kept for resumption (streams only)
    result: Result | None = None
    finished_at: float | None = None
    text: list[str] = field(default_factory=list)  # the text so far (the result's text)
    token_ids: list[int] = field(default_factory=list)  # the tokens so far

    @classmethod
    def of(cls, request: Generate, identity: bytes) -> LedgerEntry:
        return cls(_digest(request), request.stream, request.robot_id, [identity])

    @property
    def next_seq(self) -> int:
        return len(self.chunks)

    def subscribe(self, identity: bytes) -> None:
        if identity not in self.subscribers:
            self.subscribers.append(identity)

    def rejoin(self, identity: bytes, retry: Generate) -> list[Message]:
        """A ``generate`` again under this entry's id: the replies to send ``identity`` now.

        The same request subscribes it (later chunks and the result follow) and returns the
        chunks from ``retry.resume_from`` on and the result if there is one; a different request
        under the id gets an ``invalid_request`` error and changes nothing.
        """
        if self.fingerprint != _digest(retry):
            return [id_in_use(retry.request_id)]
        self.subscribe(identity)
        replies: list[Message] = list(self.chunks[retry.resume_from:]) if self.stream else []
        if self.result is not None:
            replies.append(self.result)
        return replies


def id_in_use(request_id: str) -> Error:
    """The answer to a request under an id that another request holds."""
    return Error(ErrorCode.INVALID_REQUEST, f"request_id {request_id!r} is in use by a different request", request_id)


class RequestLedger:
    def __init__(self, ttl_s: float = 300.0, max_entries: int = 10_000):
        if ttl_s <= 0 or max_entries < 1:
            raise ValueError("ttl_s must be > 0 and max_entries >= 1")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._live: dict[str, LedgerEntry] = {}
        self._finished: OrderedDict[str, LedgerEntry] = OrderedDict()  # in finishing order

    def get(self, request_id: str) -> LedgerEntry | None:
        return self._live.get(request_id) or self._finished.get(request_id)

    def open(self, request: Generate, identity: bytes) -> LedgerEntry:
        """Record a new running request (its id must not be in the ledger)."""
        assert self.get(request.request_id) is None
        entry = LedgerEntry.of(request, identity)
        self._live[request.request_id] = entry
        return entry

    def close(self, request_id: str, result: Result, now: float) -> LedgerEntry:
        """The request ended with ``result``: keep it for retries until ``now + ttl_s``."""
        entry = self._live.pop(request_id)
        entry.result = result
        entry.finished_at = now
        entry.text, entry.token_ids = [], []  # the result holds them
        self._remember(request_id, entry)
        return entry

    def cancel(self, request_id: str, identity: bytes, robot: str | None = None) -> Message | None:
        """A ``cancel`` from ``identity``: the reply to send it now, or None when the request is
        live, in which case ``identity`` is now a subscriber (the request's end, finish reason
        ``abort``, goes to it) and the caller stops the request. An unknown id, or one of
        another robot than ``robot`` (when given), is ``not_found``; a finished request's answer
        is its kept result."""
        entry = self.get(request_id)
        if entry is None or (robot is not None and entry.robot_id != robot):
            return Error(ErrorCode.NOT_FOUND, f"no request {request_id!r}", request_id)
        if entry.result is not None:
            return entry.result
        entry.subscribe(identity)
        return None

    def keep(self, kept: KeptResult, finished_at: float) -> None:
        """A request that finished before a restart, as its journal kept it: a retry gets its
        result until ``finished_at + ttl_s`` (its chunks are not kept: the result holds the
        whole answer)."""
        self._remember(kept.request_id, LedgerEntry(kept.fingerprint, kept.stream, kept.robot_id, [],
                                                    result=kept.result, finished_at=finished_at))

    def _remember(self, request_id: str, entry: LedgerEntry) -> None:
        self._finished[request_id] = entry
        while len(self._finished) > self.max_entries:
            self._finished.popitem(last=False)

    def discard(self, request_id: str) -> None:
        """Forget a live request that has no result: rejected after ``open``, or failed in the
        engine; a retry with its id runs it anew."""
        self._live.pop(request_id, None)

    def expire(self, now: float) -> int:
        """Drop finished entries older than the TTL; returns how many."""
        n = 0
        while self._finished:
            rid, entry = next(iter(self._finished.items()))
            if now - entry.finished_at < self.ttl_s:
                break
            del self._finished[rid]
            n += 1
        return n

    @property
    def live(self) -> dict[str, LedgerEntry]:
        return self._live

    def __len__(self) -> int:
        return len(self._live) + len(self._finished)


def _digest(request: Generate) -> bytes:
    return hashlib.blake2b(repr(request.fingerprint()).encode(), digest_size=16).digest()
