"""Per-robot limits: requests per second and tokens per minute, each a token bucket per robot,
and the requests a robot may have in flight at once. (A daemon's front also keeps a bucket of
frames per sender: a "robot" there is a CURVE key or a connection, a "request" any frame.)

A request is charged twice, each time before the work it pays for: one from the request bucket
on arrival (that bounds the preparing it causes), then, once prepared (its prompt tokenized),
its prompt's tokens plus its ``max_tokens`` from the token bucket, before the lane admits it. A
prompt of 7,000 tokens costs 7,000 tokens of quota, not 1. A request over either is answered at
once (``rejected`` with ``retry_after_ms``; HTTP 429 with ``Retry-After``) and charges nothing
of the bucket it failed; a request refused for its tokens still spent its request (it was
prepared). A request whose tokens are more than a minute's quota is ``invalid_request``: it
never fits. A retry of a request already in the ledger is not charged. With CURVE the robot is
its key, so one robot cannot spend another's quota; without it, the ``robot_id`` it claims. A
rate of 0 turns that limit off. Buckets are kept for the ``max_robots`` robots seen last.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class QuotaConfig:
    requests_per_s: float = 0.0  # per robot; 0: unlimited
    burst: int = 20  # requests a robot may send at once before the rate applies
    # prompt tokens + max_tokens per robot per minute (a minute's worth may come at once); 0: unlimited
    tokens_per_min: float = 0.0

    def __post_init__(self) -> None:
        if self.requests_per_s < 0 or self.tokens_per_min < 0 or self.burst < 1:
            raise ValueError("quota rates must be >= 0 and the burst >= 1")

    @property
    def enabled(self) -> bool:
        return self.requests_per_s > 0 or self.tokens_per_min > 0


class TokenBucket:
    """``capacity`` tokens, refilled at ``rate`` per second; starts full."""

    def __init__(self, rate: float, capacity: float, now: float):
        self.rate, self.capacity = rate, capacity
        self.level, self._at = capacity, now

    def wait(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` could be taken (0: now; inf: never, past the capacity)."""
        self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
        self._at = now
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level) / self.rate)

    def take(self, amount: float) -> None:
        """After ``wait`` said 0."""
        self.level -= amount


class RobotQuotas:
    def __init__(self, config: QuotaConfig, clock: Callable[[], float] = time.monotonic, max_robots: int = 4096):
        self.config = config
        self.clock = clock
        self.max_robots = max_robots
        self._buckets: OrderedDict[str, list[TokenBucket]] = OrderedDict()  # least recently seen first

    def charge(self, robot_id: str, tokens: int, requests: int = 1) -> float:
        """Charge ``requests`` requests and ``tokens`` tokens to ``robot_id``, both or neither:
        0.0 if admitted, else the seconds until they would be (inf if never: more tokens than
        a minute's quota)."""
        now = self.clock()
        buckets = self._robot(robot_id, now)
        rates = ((requests, self.config.requests_per_s), (tokens, self.config.tokens_per_min))
        amounts = [amount for amount, rate in rates if rate > 0]
        waits = [bucket.wait(amount, now) for bucket, amount in zip(buckets, amounts, strict=True)]
        if max(waits, default=0.0) > 0:
            return max(waits)
        for bucket, amount in zip(buckets, amounts, strict=True):
            bucket.take(amount)
        return 0.0

    def _robot(self, robot_id: str, now: float) -> list[TokenBucket]:
        buckets = self._buckets.pop(robot_id, None)
        if buckets is None:
            c = self.config
            buckets = [TokenBucket(rate, capacity, now) for rate, capacity in
                       ((c.requests_per_s, c.burst), (c.tokens_per_min / 60, c.tokens_per_min)) if rate > 0]
        self._buckets[robot_id] = buckets
        if len(self._buckets) > self.max_robots:
            del self._buckets[next(iter(self._buckets))]
        return buckets


class InFlight:
    """The requests each robot has in flight (admitted, not yet answered), at most ``limit``
    each (0: no limit): one robot's flood fills its own share of a daemon's queue, never the
    whole of it, so the next robot is not turned away ``overloaded`` for another's requests.
    The counts are what a daemon's ledger and preparer hold, kept here so that admission does
    not scan them per request; ``check_integrity`` compares."""

    def __init__(self, limit: int):
        if limit < 0:
            raise ValueError(f"robot_max_in_flight must be >= 0, got {limit}")
        self.limit = limit
        self._counts: Counter[str] = Counter()

    def __len__(self) -> int:
        """Robots with a request in flight."""
        return len(self._counts)

    def has_room(self, robot_id: str) -> bool:
        return not self.limit or self._counts[robot_id] < self.limit

    def admit(self, robot_id: str) -> None:
        """Count one more request of ``robot_id`` (after ``has_room`` said so)."""
        self._counts[robot_id] += 1

    def release(self, robot_id: str) -> None:
        """An admitted request of ``robot_id`` was answered (once per ``admit``)."""
        assert self._counts[robot_id] > 0, f"robot {robot_id!r} released more requests than it had admitted"
        self._counts[robot_id] -= 1
        if not self._counts[robot_id]:
            del self._counts[robot_id]

    def check_integrity(self, held: Counter[str]) -> None:
        """``held``: each robot's requests being prepared or running, counted where they are."""
        assert self._counts == held, f"in flight {dict(self._counts)} but held {dict(held)}"
