"""Fair admission at the cluster front: which admitted request goes to the replicas next.

The front lets at most ``capacity`` requests be held by the replicas at once (``[cluster]
dispatch_per_replica`` times the replicas running: what their engines run plus a short queue
each, so that their schedulers still have a mix to batch and prioritize). The rest wait here,
where every robot's work across the cluster is known, in one queue per robot. Whenever a slot
frees, the next request is the head of the waiting robot that holds the fewest requests in the
replicas (max-min fairness over in-flight requests: a robot flooding the cluster gets a slot only
when no robot holding fewer is waiting, so its share shrinks to everyone else's as theirs come
in), ties to the more urgent head, then to the earliest. Within a robot, its requests go most
urgent first, then in arrival order. ``safety`` requests never wait here: they go at once, even
past ``capacity`` (every replica's policy preempts lower classes for them). Nothing waits while
a slot is free: a robot alone gets the whole cluster.

Not thread-safe: the cluster front calls it on its loop's thread only. A scan over the waiting
robots picks each request (a few microseconds per thousand robots waiting).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from shared.protocol.messages import Priority

T = TypeVar("T")


@dataclass(order=True)
class _Waiting(Generic[T]):
    rank: int  # Priority.rank: lower goes first
    seq: int  # arrival order
    request_id: str = field(compare=False)
    robot: str = field(compare=False)
    item: T = field(compare=False)


@dataclass
class FairDispatch(Generic[T]):
    """Requests (``item``: what the caller dispatches) waiting per robot, and every robot's count
    of requests in the replicas. ``add`` then ``take`` to start what may start; ``ended`` when a
    dispatched request ends; ``withdraw`` a waiting one (cancelled)."""

    in_flight: Counter[str] = field(default_factory=Counter)  # robot -> its requests in the replicas
    _robot_of: dict[str, str] = field(default_factory=dict)  # dispatched request id -> its robot
    _waiting: dict[str, list[_Waiting[T]]] = field(default_factory=dict)  # robot -> heap of its waiting requests
    _waiting_ids: dict[str, str] = field(default_factory=dict)  # waiting request id -> its robot
    _safety: list[_Waiting[T]] = field(default_factory=list)  # safety requests, until the next take
    _seq: itertools.count = field(default_factory=itertools.count)

    def add(self, request_id: str, robot: str, priority: Priority, item: T) -> None:
        """Queue an admitted request under its robot (``request_id`` unique among those held)."""
        if request_id in self._robot_of or request_id in self._waiting_ids:
            raise ValueError(f"request {request_id!r} is already held")
        waiting = _Waiting(priority.rank, next(self._seq), request_id, robot, item)
        if priority is Priority.SAFETY:
            self._safety.append(waiting)
        else:
            heapq.heappush(self._waiting.setdefault(robot, []), waiting)
        self._waiting_ids[request_id] = robot

    def take(self, capacity: int) -> list[T]:
        """The waiting requests that go to the replicas now, in order: every ``safety`` one, then
        the fairest while fewer than ``capacity`` are in flight. Each is counted in flight."""
        safety, self._safety = self._safety, []
        taken = [self._dispatch(w) for w in safety]
        while self._waiting and self.total < capacity:
            robot = min(self._waiting, key=lambda r: (self.in_flight[r], self._waiting[r][0]))
            heap = self._waiting[robot]
            waiting = heapq.heappop(heap)
            if not heap:
                del self._waiting[robot]
            taken.append(self._dispatch(waiting))
        return taken

    def ended(self, request_id: str) -> None:
        """A dispatched request ended (its slot is free for ``take``); unknown ids are ignored."""
        robot = self._robot_of.pop(request_id, None)
        if robot is not None:
            self.in_flight[robot] -= 1
            if not self.in_flight[robot]:
                del self.in_flight[robot]

    def withdraw(self, request_id: str) -> T | None:
        """Remove a waiting request; its item, or None when it is not waiting (dispatched or unknown)."""
        robot = self._waiting_ids.pop(request_id, None)
        if robot is None:
            return None
        in_safety = any(w.request_id == request_id for w in self._safety)
        heap = self._safety if in_safety else self._waiting[robot]
        (gone,) = [w for w in heap if w.request_id == request_id]
        heap.remove(gone)
        if not in_safety:
            heapq.heapify(heap)
            if not heap:
                del self._waiting[robot]
        return gone.item

    @property
    def total(self) -> int:
        """Requests in the replicas now."""
        return len(self._robot_of)

    @property
    def waiting(self) -> int:
        return len(self._waiting_ids)

    def snapshot(self) -> dict:
        """For ``stats``: requests in the replicas, waiting here, and the robots they wait for."""
        return {"in_flight": self.total, "waiting": self.waiting, "robots_waiting": len(self._waiting)}

    def _dispatch(self, waiting: _Waiting[T]) -> T:
        """Count ``waiting`` (already out of its queue) in flight."""
        del self._waiting_ids[waiting.request_id]
        self._robot_of[waiting.request_id] = waiting.robot
        self.in_flight[waiting.robot] += 1
        return waiting.item
