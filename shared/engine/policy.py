"""The order in which waiting requests are admitted, and which running request yields first.

A policy is one sort key, defined once: smaller keys are admitted first, and when memory runs
out the running request with the largest key is preempted. Later issues add priority classes,
deadlines, per-robot fairness and cache-aware ordering as further policies.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Protocol

from shared.engine.request import Request


class SchedulingPolicy(Protocol):
    def key(self, req: Request) -> tuple:
        """Sort key: smaller goes first; must not change while the request waits."""
        ...


class FCFS:
    """First come, first served."""

    def key(self, req: Request) -> tuple:
        return (req.arrival_seq,)


class WaitingQueue:
    """Waiting requests kept sorted by the policy key (ties by insertion)."""

    def __init__(self, policy: SchedulingPolicy):
        self._policy = policy
        self._keys: list[tuple] = []
        self._reqs: list[Request] = []

    def add(self, req: Request) -> None:
        key = self._policy.key(req)
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._reqs.insert(i, req)

    def remove(self, req: Request) -> None:
        i = self._reqs.index(req)
        del self._keys[i]
        del self._reqs[i]

    def __contains__(self, req: Request) -> bool:
        return req in self._reqs

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._reqs))

    def __len__(self) -> int:
        return len(self._reqs)
