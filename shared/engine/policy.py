"""Who goes first: the order of waiting requests, the order of running work, who yields.

A policy's ``key(req, now)`` is the one measure of how deserving a request is (smaller goes
first): the scheduler admits waiting requests in ``order`` (the keys, refined by whatever the
policy knows about the prefix cache), runs prefill chunks in key order, and when memory runs
out preempts the running request with the largest key. Keys may change over time (ageing,
fairness counters), so they are recomputed every step rather than stored.

``FCFS`` is the engine's default. ``FleetPolicy`` is what cloudd runs for a robot fleet:
priority classes that preempt, deadlines, per-robot fairness, ageing and cache-aware ordering.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from shared.engine.request import Request
from shared.protocol.messages import Priority

PrefixLen = Callable[[Request], int]  # tokens of a request's prompt the prefix cache holds now


class SchedulingPolicy:
    """The neutral base: subclasses define ``key``; every hook has a do-nothing default."""

    name = "custom"  # how stats and benchmarks name the policy

    def key(self, req: Request, now: float) -> tuple:
        """Sort key at time ``now``: smaller is admitted and runs first, larger yields first."""
        raise NotImplementedError

    def order(self, waiting: Sequence[Request], now: float, prefix_len: PrefixLen) -> list[Request]:
        """Waiting requests in admission order."""
        return sorted(waiting, key=lambda r: self.key(r, now))

    def is_urgent(self, req: Request) -> bool:
        """Is waiting ``req`` admitted before any running work of a step, taking seats and
        memory from the running requests it ``preempts``?"""
        return False

    def preempts(self, waiting: Request, running: Request) -> bool:
        """May urgent ``waiting`` take ``running``'s seat and memory at admission?"""
        return False

    def on_add(self, req: Request) -> None:
        """``req`` entered the engine."""

    def on_served(self, req: Request, prompt_tokens: int, output_tokens: int) -> None:
        """``req`` had ``prompt_tokens`` computed and ``output_tokens`` sampled this step."""

    def on_finish(self, req: Request) -> None:
        """``req`` left the engine (finished, aborted or expired)."""


class FCFS(SchedulingPolicy):
    """First come, first served; the latest arrival yields first."""

    name = "fcfs"

    def key(self, req: Request, now: float) -> tuple:
        return (req.arrival_seq,)


@dataclass(frozen=True)
class FleetPolicyConfig:
    """Knobs of ``FleetPolicy`` (the ``[policy]`` table of cloudd's config)."""

    preempting_classes: tuple[str, ...] = ("safety",)  # waiting ones take lower classes' seats
    ageing_s: float = 30.0  # a request waiting longer goes ahead of every non-safety request
    prompt_token_weight: float = 1.0  # VTC service per computed prompt token
    output_token_weight: float = 2.0  # VTC service per generated token
    cache_aware_window: int = 32  # head of the queue reordered by prefix match (bounds cost)
    cache_aware_min_tokens: int = 32  # shorter matches count as none (noise, not a warm prefix)
    fairness_slack_tokens: float = 128.0  # robots this close in service count as equal

    def __post_init__(self) -> None:
        valid = {p.value for p in Priority}
        for name in self.preempting_classes:
            if name not in valid:
                raise ValueError(f"preempting_classes: {name!r} is not one of {sorted(valid)}")
        for name in ("ageing_s", "prompt_token_weight", "output_token_weight", "fairness_slack_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("cache_aware_window", "cache_aware_min_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


class FleetPolicy(SchedulingPolicy):
    """Priority classes, deadlines, per-robot fairness, ageing and cache-aware ordering.

    The order, most deserving first:

    1. ``safety`` requests (earliest deadline first, then fairness);
    2. any other request that has waited ``ageing_s`` since it arrived, oldest first, so no
       request's wait is unbounded however busy the higher classes are;
    3. the remaining classes in rank order (``interactive``, ``plan``, ``background``); inside a
       class, earliest deadline first (requests without a deadline after those with one), then
       the robot with the least service so far (a virtual token counter, as in VTC), then
       arrival.

    Fairness: each robot's counter grows by the tokens it is served (prompt tokens computed and
    tokens generated, weighted). A robot that becomes active again is lifted to the smallest
    counter among active robots, so idling never banks credit: a robot flooding the queue gets
    the same share of service as any other backlogged robot, no more.

    Cache awareness: within the first ``cache_aware_window`` requests of the order, a run of
    requests that fairness treats as equal (same class, no deadline, robot counters within
    ``fairness_slack_tokens`` of the run's first) is reordered longest prefix match first
    (matches under ``cache_aware_min_tokens`` count as none), so requests sharing a warm prefix
    go while it is warm. At most ``cache_aware_window`` prefix matches per step.

    A waiting class named in ``preempting_classes`` takes the seat and memory of running requests
    of lower classes at admission; those keep their prefix in the cache and resume later.
    """

    name = "fleet"

    def __init__(self, config: FleetPolicyConfig = FleetPolicyConfig()):
        self.config = config
        self._preempting = frozenset(Priority(name) for name in config.preempting_classes)
        self._served: dict[str, float] = defaultdict(float)  # robot -> virtual token counter
        self._active: dict[str, int] = defaultdict(int)  # robot -> requests in the engine

    def key(self, req: Request, now: float) -> tuple:
        deadline = req.deadline if req.deadline is not None else math.inf
        if req.priority is Priority.SAFETY:
            return (0, deadline, self._served[req.robot_id], req.arrival_seq)
        if now - req.arrival_time >= self.config.ageing_s:
            return (1, 0.0, 0.0, req.arrival_seq)
        return (1 + req.priority.rank, deadline, self._served[req.robot_id], req.arrival_seq)

    def order(self, waiting: Sequence[Request], now: float, prefix_len: PrefixLen) -> list[Request]:
        keyed = sorted(((self.key(r, now), r) for r in waiting), key=lambda kr: kr[0])
        window = keyed[: self.config.cache_aware_window]
        ordered: list[Request] = []
        floor = self.config.cache_aware_min_tokens

        def warmth(req: Request) -> int:
            n = prefix_len(req)
            return n if n >= floor else 0

        for run in self._equal_runs(window):
            ordered.extend(sorted(run, key=warmth, reverse=True) if len(run) > 1 else run)
        ordered.extend(r for _, r in keyed[len(window) :])
        return ordered

    def _equal_runs(self, keyed: list[tuple[tuple, Request]]) -> Iterator[list[Request]]:
        """Split a key-sorted list into runs that fairness treats as equal."""
        run: list[Request] = []
        head: tuple | None = None
        for key, req in keyed:
            tier, deadline, served, _ = key
            if head is not None and not (
                tier == head[0] and deadline == math.inf == head[1]
                and served - head[2] <= self.config.fairness_slack_tokens
                and tier != 1  # aged requests stay oldest first
            ):
                yield run
                run, head = [], None
            if head is None:
                head = key
            run.append(req)
        if run:
            yield run

    def is_urgent(self, req: Request) -> bool:
        return req.priority in self._preempting

    def preempts(self, waiting: Request, running: Request) -> bool:
        return running.priority.rank > waiting.priority.rank

    def on_add(self, req: Request) -> None:
        robot = req.robot_id
        if self._active[robot] == 0:
            others = [self._served[r] for r, n in self._active.items() if n > 0]
            if others:
                self._served[robot] = max(self._served[robot], min(others))
        self._active[robot] += 1

    def on_served(self, req: Request, prompt_tokens: int, output_tokens: int) -> None:
        c = self.config
        self._served[req.robot_id] += c.prompt_token_weight * prompt_tokens + c.output_token_weight * output_tokens

    def on_finish(self, req: Request) -> None:
        self._active[req.robot_id] -= 1
        if self._active[req.robot_id] == 0:
            del self._active[req.robot_id]

    def served(self, robot_id: str) -> float:
        """The robot's virtual token counter (for stats and tests)."""
        return self._served.get(robot_id, 0.0)
