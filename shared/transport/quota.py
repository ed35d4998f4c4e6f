"""Per-robot rate limits: requests per second and generated tokens per minute, each a token
bucket per robot. (A daemon's front also keeps one of frames per sender with the same buckets:
a "robot" there is a CURVE key or a connection, a "request" any frame.)

A request is charged on arrival (a retry of a request already in the ledger is not): one from
the request bucket, its ``max_tokens`` from the token bucket. It is admitted only if both hold
enough; otherwise neither is charged and the caller learns how long until they would
(``rejected`` with ``retry_after_ms``; HTTP 429 with ``Retry-After``). With CURVE the robot is
its key, so one robot cannot spend another's quota; without it, the ``robot_id`` it claims. A
rate of 0 turns that limit off. Buckets are kept for the ``max_robots`` robots seen last.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class QuotaConfig:
    requests_per_s: float = 0.0  # per robot; 0: unlimited
    burst: int = 20  # requests a robot may send at once before the rate applies
    tokens_per_min: float = 0.0  # max_tokens per robot per minute (a minute's worth may come at once); 0: unlimited

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

    def charge(self, robot_id: str, max_tokens: int) -> float:
        """Charge one request of ``max_tokens`` to ``robot_id``: 0.0 if admitted, else the
        seconds until it would be (inf if it never would: more tokens than a minute's quota)."""
        now = self.clock()
        buckets = self._robot(robot_id, now)
        amounts = [amount for amount, rate in ((1, self.config.requests_per_s), (max_tokens, self.config.tokens_per_min))
                   if rate > 0]
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
