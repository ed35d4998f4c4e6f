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

The meters read ``WorkMeter.timer``: ``time.thread_time``, the engine thread's CPU time, so a
request is charged its own work and never the time the thread waited for a core or the GIL
(a loaded host must not end requests). A test sets a fake timer on the class or on one meter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

Timer = Callable[[], float]


class WorkMeter:
    """Seconds of one request's own work since the last ``take``; used on the engine's thread.
    It reads ``timer``: the class's (``time.thread_time``) unless one is set on the meter."""

    timer: Timer = staticmethod(time.thread_time)

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
