"""What the node reports on /diagnostics: the endpoint's reachability and the last plan's
latency. Plain Python (no rclpy); the node turns ``report()`` into a DiagnosticStatus.

Thread-safe: plans finish on executor threads while the diagnostics timer reads.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass


class Level(enum.IntEnum):
    """diagnostic_msgs/DiagnosticStatus levels (same byte values)."""

    OK = 0
    WARN = 1
    ERROR = 2
    STALE = 3


@dataclass(frozen=True)
class Report:
    level: Level
    message: str
    values: tuple[tuple[str, str], ...]


class EndpointStatus:
    """The last health probe and plan outcomes of one endpoint."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self._lock = threading.Lock()
        self._probed = False
        self._reachable = False
        self._daemon_status = ""
        self._probe_ms: float | None = None
        self._last_latency_s: float | None = None
        self._last_source = ""
        self._last_ok: bool | None = None
        self._plans_ok = 0
        self._plans_failed = 0

    def probed(self, daemon_status: str | None, probe_ms: float | None) -> None:
        """A probe's outcome: the daemon's status, or None when it did not answer."""
        with self._lock:
            self._probed = True
            self._reachable = daemon_status is not None
            self._daemon_status = daemon_status or ""
            self._probe_ms = probe_ms

    def planned(self, ok: bool, latency_s: float, source: str) -> None:
        with self._lock:
            self._last_ok = ok
            self._last_latency_s = latency_s
            self._last_source = source
            if ok:
                self._plans_ok += 1
            else:
                self._plans_failed += 1

    def report(self, active_plans: int, max_plans: int) -> Report:
        """ERROR: unreachable; WARN: not yet probed, daemon not "ok", or the last plan failed."""
        with self._lock:
            if not self._probed:
                level, message = Level.STALE, "not probed yet"
            elif not self._reachable:
                level, message = Level.ERROR, f"{self.endpoint} does not answer"
            elif self._daemon_status != "ok":
                level, message = Level.WARN, f"daemon is {self._daemon_status!r}"
            elif self._last_ok is False:
                level, message = Level.WARN, "reachable; the last plan failed"
            else:
                level, message = Level.OK, "reachable"
            values = (
                ("endpoint", self.endpoint),
                ("reachable", str(self._reachable).lower()),
                ("daemon_status", self._daemon_status),
                ("probe_ms", _fmt(self._probe_ms)),
                ("last_latency_s", _fmt(self._last_latency_s)),
                ("last_source", self._last_source),
                ("active_plans", str(active_plans)),
                ("max_concurrent_goals", str(max_plans)),
                ("plans_ok", str(self._plans_ok)),
                ("plans_failed", str(self._plans_failed)),
            )
        return Report(level, message, values)


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"
