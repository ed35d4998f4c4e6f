"""The victim robot of the hostile-tenant phase: it streams realistic plans from cloudd (robot_sdk
``PlanClient.stream`` over ZeroMQ with its own CURVE key, the soak's skills, scene and tasks)
back to back for one window, and records every wait between the chunks it receives (the gaps of
``soak.hostile_bar``) and, apart, each plan's wait for its first chunk (its prefill: a few per
window, reported beside the gaps).

Every plan has a 30 s deadline and the fleet's skill set, whose grammar cloudd compiled at
start-up (``precompile``): the victim measures the serving path, not a compile (one new
grammar's compile of seconds would be the p99 of a window's hundred gaps, baseline and attack
alike, and hide every stall shorter than it). An attack on compiles (``schema_slow_compile``)
therefore shows here only if it holds more than the compile thread.

A plan is *answered* by a plan or by one of robot_sdk's typed errors; ``InvalidPlan`` (the model
wrote a plan that breaks its skills) is the model's answer, any other typed error is *refused*
(the daemon did not serve the robot). A plan with no answer ``LOST_AFTER_S`` past its deadline,
or one that ended in an exception robot_sdk does not define, is *lost*.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from robot_sdk import PlanClient
from robot_sdk.errors import PlanError
from robot_sdk.replies import PlanDone, PlanText
from soak.plans import LATE_MARGIN_S, MAX_STEPS, SCENE, SKILLS, TASKS

VICTIM_DEADLINE_MS = 30_000
LOST_AFTER_S = LATE_MARGIN_S + 30.0  # past the deadline with no answer: lost (as soak.plans counts)
SERVED = ("plan", "InvalidPlan")  # the answers that are not refusals (InvalidPlan: the model's own)


@dataclass
class VictimWindow:
    """What the victim saw in one window."""

    gaps: list[float] = field(default_factory=list)  # between chunks, and the wait open at the window's end
    first_chunk_waits: list[float] = field(default_factory=list)  # from each plan's send to its first chunk
    # one per plan sent: "plan", "InvalidPlan", a refusal's error name, or "lost[:<why>]"
    answers: Counter = field(default_factory=Counter)

    @property
    def plans(self) -> int:
        """Plans sent."""
        return sum(self.answers.values())

    @property
    def lost(self) -> int:
        return sum(n for answer, n in self.answers.items() if answer.startswith("lost"))

    @property
    def refused(self) -> int:
        return self.plans - self.lost - sum(self.answers[answer] for answer in SERVED)


class Victim:
    """Streams plans for ``seconds`` from a fresh client (``clients()``), then stops sending and
    waits for the plan in flight; ``run`` returns the window's figures."""

    def __init__(self, clients: Callable[[], PlanClient]):
        self.clients = clients

    def run(self, seconds: float) -> VictimWindow:
        figures = VictimWindow()
        lock = threading.Lock()
        ends = time.monotonic() + seconds
        last_event: list[float | None] = [None]  # the start of the open wait; None between plans
        stop = threading.Event()

        def seen(now: float, first: bool) -> None:
            with lock:
                if last_event[0] is not None and now <= ends:
                    (figures.first_chunk_waits if first else figures.gaps).append(now - last_event[0])
                last_event[0] = now

        def loop() -> None:
            client, tasks = self.clients(), itertools.cycle(TASKS)
            try:
                while not stop.is_set() and time.monotonic() < ends:
                    answer = self._one_plan(client, next(tasks), seen, last_event, lock)
                    with lock:
                        figures.answers[answer] += 1
            finally:
                client.close()

        thread = threading.Thread(target=loop, name="victim", daemon=True)
        thread.start()
        thread.join(max(0.0, ends - time.monotonic()))
        stop.set()
        with lock:
            if last_event[0] is not None and last_event[0] < ends:
                figures.gaps.append(ends - last_event[0])  # the wait still open at the window's end
            last_event[0] = None
        thread.join(VICTIM_DEADLINE_MS / 1000 + LOST_AFTER_S)
        if thread.is_alive():  # its plan in flight never got an answer
            with lock:
                figures.answers["lost"] += 1
        return figures

    @staticmethod
    def _one_plan(client: PlanClient, task: str, seen: Callable[[float, bool], None],
                  last_event: list[float | None], lock: threading.Lock) -> str:
        """Stream one plan, calling ``seen`` at every text chunk (``first`` for the first); its
        answer's name."""
        with lock:
            last_event[0] = time.monotonic()
        first = True
        try:
            for event in client.stream(task, scene=SCENE, skills=SKILLS, max_steps=MAX_STEPS,
                                       deadline_ms=VICTIM_DEADLINE_MS):
                if isinstance(event, PlanText):
                    seen(time.monotonic(), first)
                    first = False
                elif isinstance(event, PlanDone):
                    return "plan"
            return "lost:stream ended without a plan"
        except PlanError as e:  # InvalidPlan among them
            return type(e).__name__
        except Exception as e:  # noqa: BLE001 -- anything else is a lost request, reported by type
            return f"lost:{type(e).__name__}: {e}"
        finally:
            with lock:
                last_event[0] = None
