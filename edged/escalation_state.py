"""Where one edged request stands between its two answers, the robot's and the cloud's, as an
explicit state machine: what edged does next is read from the state, never pieced together
from flags.

Two parts move independently:

- the local job: ``NONE`` (never started: the prompt fits only the cloud), ``RUNNING``, ``DONE``;
- the cloud call: ``UNASKED`` (not escalated, or not yet) -> ``WAITING`` -> ``ANSWERED`` or
  ``FAILED``; or ``UNASKED`` -> ``FAILED`` at once (no cloud configured, circuit breaker open).
  ``FAILED`` covers an error reply, a timeout and a cancel: the cloud is out of the picture.

``verdict()`` says what to do now: wait, answer with the cloud's result (cancelling a local job
still running), answer with the local result (a degraded fallback when it was escalated), or
answer ``unavailable`` (the prompt fits only the cloud, and the cloud failed). An event that no
longer applies (a cloud reply after the call was given up) changes nothing: ``cloud_to``
returns False for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Local(Enum):
    NONE = "none"
    RUNNING = "running"
    DONE = "done"


class Cloud(Enum):
    UNASKED = "unasked"
    WAITING = "waiting"
    ANSWERED = "answered"
    FAILED = "failed"


class Verdict(Enum):
    WAIT = "wait"
    CLOUD = "cloud"  # answer with the cloud's result
    LOCAL = "local"  # answer with the local result
    UNAVAILABLE = "unavailable"  # no local result will come and the cloud failed


# the cloud call's edges; any other event is stale and ignored
CLOUD_EDGES: frozenset[tuple[Cloud, Cloud]] = frozenset({
    (Cloud.UNASKED, Cloud.WAITING), (Cloud.UNASKED, Cloud.FAILED),
    (Cloud.WAITING, Cloud.ANSWERED), (Cloud.WAITING, Cloud.FAILED),
})


@dataclass
class EscalationState:
    local: Local
    cloud: Cloud = Cloud.UNASKED

    def cloud_to(self, target: Cloud) -> bool:
        """Move the cloud call to ``target``: True if that is an edge from where it stands,
        else False and nothing changes (a stale event)."""
        if (self.cloud, target) not in CLOUD_EDGES:
            return False
        self.cloud = target
        return True

    def local_done(self) -> None:
        """The local job ended (with a result, an error, or cancelled)."""
        if self.local is not Local.RUNNING:
            raise ValueError(f"a local job ended that is {self.local.value}")
        self.local = Local.DONE

    def verdict(self) -> Verdict:
        if self.cloud is Cloud.ANSWERED:
            return Verdict.CLOUD
        if self.cloud is Cloud.WAITING or self.local is Local.RUNNING:
            return Verdict.WAIT
        if self.local is Local.NONE:
            return Verdict.UNAVAILABLE
        return Verdict.LOCAL
