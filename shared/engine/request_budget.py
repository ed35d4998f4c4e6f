"""Each request's own host work per engine step, measured and bounded.

A request's grammar (its mask fill, the repeat guard's restriction, accepting its tokens, the
jump-forward text) and its detokenizer (decoding, stop strings) run on the engine's thread,
so their cost is every other robot's wait. Each of them charges the seconds it spends to the
request's ``WorkMeter``; after the step, ``RequestBudget.over`` reads and resets every meter of
the step's requests, and names the requests whose work in this one step passed the budget
(``EngineConfig.request_step_budget_s``): the engine ends each of them alone (finish reason
``error``, with the budget named), and the others of the batch go on. The static grammar
limits (``shared.engine.grammar.limits``) keep ordinary requests far below it; the budget
catches what no static check sees. The step's heaviest request is kept (``heaviest``) for a
daemon's ``/health``.

The meters read ``WorkMeter.timer``: ``own_cpu_time``, the engine thread's CPU time less what
Python's cyclic garbage collector took on it. So a request is charged its own work, never the
time the thread waited for a core or the GIL (a loaded host must not end requests), nor a
collection that happened to start inside its grammar call: a full collection in a process with
a model loaded takes 0.1-0.5 s, the whole process's garbage, no request's. A test sets a fake
timer on the class or on one meter.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

Timer = Callable[[], float]


class CollectorFreeClock:
    """A thread's seconds on ``base`` (its CPU time), less those the garbage collector took on it.

    A collection runs on the thread whose allocation set it off; ``on_collect``, registered in
    ``gc.callbacks``, adds each one's seconds to that thread's total, which every reading
    subtracts. Readings are per thread and never run backwards."""

    def __init__(self, base: Timer = time.thread_time) -> None:
        self.base = base
        self._thread = threading.local()  # .started (the running collection's), .collected

    def on_collect(self, phase: str, info: dict) -> None:
        """``gc.callbacks``' hook: ``phase`` is "start" or "stop"."""
        if phase == "start":
            self._thread.started = self.base()
        elif (started := getattr(self._thread, "started", None)) is not None:
            self._thread.collected = self.collected() + self.base() - started
            self._thread.started = None

    def collected(self) -> float:
        """The seconds the collector has taken on this thread so far."""
        return getattr(self._thread, "collected", 0.0)

    def __call__(self) -> float:
        return self.base() - self.collected()


own_cpu_time = CollectorFreeClock()
gc.callbacks.append(own_cpu_time.on_collect)


class WorkMeter:
    """Seconds of one request's own work since the last ``take``; used on the engine's thread.
    It reads ``timer``: the class's (``own_cpu_time``) unless one is set on the meter."""

    timer: Timer = staticmethod(own_cpu_time)

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def timing(self) -> Iterator[None]:
        """Charge the seconds the ``with`` body takes (also when it raises)."""
        start = self.timer()
        try:
            yield
        finally:
            self.seconds += self.timer() - start

    def take(self) -> float:
        """The seconds charged since the last call; the meter starts again from 0."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


@dataclass(frozen=True)
class HeavyWork:
    """One request's own work in one step."""

    request_id: str
    seconds: float

    def describe(self) -> str:
        return f"request {self.request_id} took {self.seconds:.1f} s of grammar and detokenizer work in one step"


@dataclass(frozen=True)
class Overrun:
    """A request whose work in one step passed the budget: why it ends."""

    work: HeavyWork
    budget_s: float

    @property
    def detail(self) -> str:
        return (f"request {self.work.request_id} used {self.work.seconds * 1000:.0f} ms of grammar and "
                f"detokenizer work in one step, over its budget of {self.budget_s * 1000:.0f} ms "
                "(request_step_budget_s): simplify its response_format or stop strings")


class RequestBudget:
    """The per-step budget of each request's own work (``budget_s`` seconds)."""

    def __init__(self, budget_s: float) -> None:
        if not budget_s > 0:
            raise ValueError(f"request_step_budget_s must be > 0, got {budget_s}")
        self.budget_s = budget_s
        self.heaviest: HeavyWork | None = None  # of the last step that charged any work

    def over(self, charged: Iterable[tuple[str, Iterable[WorkMeter]]]) -> list[Overrun]:
        """Take each request's meters (``(request_id, its meters)``, one step's requests) and
        return those whose work passed the budget, in the order given."""
        works = [HeavyWork(rid, sum(m.take() for m in meters)) for rid, meters in charged]
        if works:
            self.heaviest = max(works, key=lambda w: w.seconds)
        return [Overrun(w, self.budget_s) for w in works if w.seconds > self.budget_s]

    def take_heaviest(self) -> HeavyWork | None:
        """``heaviest``, once: None until a later step charges work (a step with nothing to
        run charges none, and must not report the same request again)."""
        heaviest, self.heaviest = self.heaviest, None
        return heaviest
