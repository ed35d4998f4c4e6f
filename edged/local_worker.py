"""The robot's one decode lane: a priority queue of local jobs and the thread that runs them.

Jobs wait ordered by priority class, then deadline (earliest first), then arrival. One job
runs at a time (batch 1). A job that is running yields between two tokens when a job of a more
urgent class is queued, and goes back in the queue with everything it has (see
``edged.generation``), so a safety request never waits for a background plan to finish.

Every callback (``emit``, ``done``) is called on the worker thread.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from edged.generation import Batch1Generator, LocalJob

log = logging.getLogger(__name__)


@dataclass(eq=False)
class QueuedJob:
    job: LocalJob
    rank: int  # priority class rank, lower runs first
    emit: Callable[[list[int], str], None]
    done: Callable[[LocalJob], None]
    queued_at: float
    started_at: float | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    estimate_s: float = 0.0  # expected run time, for the deadline rule

    def key(self, seq: int) -> tuple:
        deadline = self.job.deadline if self.job.deadline is not None else float("inf")
        return (self.rank, deadline, seq)


class LocalWorker:
    def __init__(self, generator: Batch1Generator):
        self.generator = generator
        self._heap: list[tuple[tuple, QueuedJob]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._running: QueuedJob | None = None
        self._stopped = False
        self._jobs: dict[str, QueuedJob] = {}
        self.rate = RateEstimate()
        self._thread = threading.Thread(target=self._loop, name="edged-local", daemon=True)
        self._thread.start()

    def submit(self, queued: QueuedJob) -> None:
        with self._cv:
            self._jobs[queued.job.request_id] = queued
            heapq.heappush(self._heap, (queued.key(next(self._seq)), queued))
            self._cv.notify_all()

    def cancel(self, request_id: str) -> bool:
        """Stop a queued or running job (its ``done`` still comes, finish reason abort)."""
        with self._cv:
            queued = self._jobs.get(request_id)
            if queued is None:
                return False
            queued.cancelled.set()
            self._cv.notify_all()
            return True

    def wait_estimate_s(self, rank: int, deadline: float | None, own_s: float) -> float:
        """Seconds until a new job of ``rank``/``deadline`` would finish: the work ordered
        before it (including what runs now) plus its own ``own_s``."""
        key = (rank, deadline if deadline is not None else float("inf"))
        with self._cv:
            ahead = sum(q.estimate_s for k, q in self._heap if k[:2] <= key and not q.cancelled.is_set())
            running = self._running
            if running is not None:
                elapsed = time.monotonic() - (running.started_at or time.monotonic())
                ahead += max(0.0, running.estimate_s - elapsed)
        return ahead + own_s

    @property
    def depth(self) -> int:
        with self._cv:
            return len(self._heap) + (self._running is not None)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join()

    def _urgent_waiting(self, rank: int) -> bool:
        with self._cv:
            return bool(self._heap) and self._heap[0][1].rank < rank

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                _, queued = heapq.heappop(self._heap)
                self._running = queued
            if queued.started_at is None:
                queued.started_at = time.monotonic()
            finished = self._run(queued)
            with self._cv:
                self._running = None
                if finished:
                    self._jobs.pop(queued.job.request_id, None)
                else:  # preempted: back in line, ahead of its class's later arrivals
                    heapq.heappush(self._heap, (queued.key(next(self._seq)), queued))
            if finished:
                queued.done(queued.job)

    def _run(self, queued: QueuedJob) -> bool:
        job = queued.job
        before_tokens, start = len(job.generated), time.monotonic()
        prefill_before = job.prefilled_tokens
        try:
            finished = self.generator.run(job, queued.emit, lambda: self._urgent_waiting(queued.rank),
                                          queued.cancelled.is_set)
        except Exception as e:  # a backend failure ends this job, never the daemon
            log.exception("local generation of %s failed", job.request_id)
            job.error = f"local generation failed: {type(e).__name__}: {e}"
            return True
        self.rate.observe(job.prefilled_tokens - prefill_before, len(job.generated) - before_tokens,
                          time.monotonic() - start)
        return finished


class RateEstimate:
    """Local prefill and decode speed (tokens/s), a moving average over finished runs."""

    def __init__(self, prefill_tok_s: float = 300.0, decode_tok_s: float = 20.0, weight: float = 0.3):
        self.prefill_tok_s = prefill_tok_s
        self.decode_tok_s = decode_tok_s
        self.weight = weight

    def observe(self, prefilled: int, decoded: int, seconds: float) -> None:
        if decoded < 4 or seconds <= 0:
            return
        prefill_s = prefilled / self.prefill_tok_s
        decode_s = max(seconds - prefill_s, 1e-3)
        self.decode_tok_s += self.weight * (decoded / decode_s - self.decode_tok_s)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 16 and seconds > 0:
            self.prefill_tok_s += self.weight * (tokens / seconds - self.prefill_tok_s)

    def seconds(self, prefill_tokens: int, decode_tokens: int) -> float:
        return prefill_tokens / self.prefill_tok_s + decode_tokens / self.decode_tok_s
