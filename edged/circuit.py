"""A circuit breaker for the link to cloudd.

Closed: escalations go to the cloud; ``failure_threshold`` failures in a row open it. Open:
escalations are answered on the robot at once (no waiting on a dead link) for ``cooldown_s``.
Then half-open: the next escalation is let through as a trial; its success closes the
breaker, its failure opens it for another cooldown. Thread-safe.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, failure_threshold: int = 3, cooldown_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        if failure_threshold < 1 or cooldown_s <= 0:
            raise ValueError("failure_threshold must be >= 1 and cooldown_s > 0")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None
        self._trial_out = False  # half-open: a trial escalation is in flight
        self.opened_count = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state()

    def allow(self) -> bool:
        """May an escalation go to the cloud now? In half-open, only one trial at a time."""
        with self._lock:
            state = self._state()
            if state is BreakerState.CLOSED:
                return True
            if state is BreakerState.HALF_OPEN and not self._trial_out:
                self._trial_out = True
                return True
            return False

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0
            self._opened_at = None
            self._trial_out = False

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._trial_out or self._failures >= self.failure_threshold:
                if self._opened_at is None or self._trial_out:
                    self.opened_count += 1
                self._opened_at = self.clock()
                self._trial_out = False

    def _state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self.clock() - self._opened_at < self.cooldown_s:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN
