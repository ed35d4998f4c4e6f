"""Plan traffic for the soak: robots asking for real plans (robot_sdk ``PlanClient``), each
request's one final answer recorded with when it came.

An *answer* is a plan (``result``) or one of robot_sdk's typed errors (``DeadlineExceeded``,
``Unavailable``, ``Rejected``, ``InvalidPlan``, ...). A request whose call is still waiting when
the harness stops waiting is *lost*, and so is one that ended in anything else (an exception
robot_sdk does not define is a bug). An answer later than the deadline plus ``LATE_MARGIN_S`` is
*late*.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from robot_sdk import PlanClient
from robot_sdk.errors import PlanError
from robot_sdk.skills import Skill
from shared.engine.grammar.response_format import AMR_SKILLS

MAX_STEPS = 3  # steps per plan: edged pins the system prompt for exactly this
LATE_MARGIN_S = 1.0  # past a deadline: robot_sdk's own 0.5 s grace, plus scheduling slack
NO_DEADLINE_CAP_S = 240.0  # a request without a deadline that has no answer by then is lost
SCENE = ("Scene: Robot amr. Battery 58 percent. Current location: charging dock 2. "
         "Tote 12 is on waypoint 17. Shelf A3 is in aisle 4.")
TASKS = ("bring tote 12 from waypoint 17 to shelf A3.", "go to charging dock 2 and report the battery.",
         "lift the shelf at waypoint 9 and lower it at waypoint 4.", "a person is in aisle 4: stop and report.")


# the fleet's warehouse-robot skills (the ones cloudd's "fleet-plan" format lists)
SKILLS = [Skill.of(s["name"], s["description"], s["args"]) for s in AMR_SKILLS]


@dataclass(frozen=True)
class PlanAsk:
    """One plan request as a robot sends it."""

    robot: str
    task: str
    deadline_ms: int | None = None
    priority: str = "plan"
    tags: tuple[str, ...] = ()
    max_tokens: int = 160


@dataclass
class Outcome:
    ask: PlanAsk
    request_id: str
    sent_at: float
    answered_at: float | None = None
    answer: str | None = None  # "plan:<source>[:degraded]" or the typed error's class name

    @property
    def kind(self) -> str:
        """The answer without its details: "plan", a typed error's name, "lost" or "none"."""
        return self.answer.split(":")[0] if self.answer else "none"

    @property
    def late(self) -> bool:
        if self.answered_at is None or self.ask.deadline_ms is None:
            return False
        return self.answered_at - self.sent_at > self.ask.deadline_ms / 1000 + LATE_MARGIN_S

    @property
    def lost(self) -> bool:
        return self.answer is None or self.answer.startswith("lost:")


@dataclass
class Traffic:
    """Plan requests in flight from their own threads; ``wait`` collects every outcome."""

    clients: Callable[[str], PlanClient]
    outcomes: list[Outcome] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)

    def send(self, ask: PlanAsk) -> Outcome:
        client = self.clients(ask.robot)
        outcome = Outcome(ask, client.new_request_id(), time.monotonic())
        self.outcomes.append(outcome)
        thread = threading.Thread(target=self._run, args=(client, outcome), daemon=True)
        thread.start()
        self._threads.append(thread)
        return outcome

    def join(self) -> None:
        """Wait for every request's answer (bounded by its deadline, or ``NO_DEADLINE_CAP_S``)."""
        for thread, outcome in zip(self._threads, self.outcomes, strict=True):
            deadline_s = outcome.ask.deadline_ms / 1000 + LATE_MARGIN_S if outcome.ask.deadline_ms else NO_DEADLINE_CAP_S
            thread.join(max(0.0, outcome.sent_at + deadline_s + 30.0 - time.monotonic()))

    def wait(self) -> list[Outcome]:
        """``join``, then hand over every outcome so far (the next ``wait`` starts afresh)."""
        self.join()
        done, self.outcomes, self._threads = self.outcomes, [], []
        return done

    @staticmethod
    def _run(client: PlanClient, outcome: Outcome) -> None:
        ask = outcome.ask
        try:
            plan = client.plan(ask.task, scene=SCENE, skills=SKILLS, max_steps=MAX_STEPS, max_tokens=ask.max_tokens,
                               priority=ask.priority, deadline_ms=ask.deadline_ms, tags=list(ask.tags),
                               request_id=outcome.request_id)
            answer = f"plan:{plan.source}" + (":degraded" if plan.degraded else "")
        except PlanError as e:
            answer = type(e).__name__
        except Exception as e:  # noqa: BLE001 -- anything else is a lost request, reported by type
            answer = f"lost:{type(e).__name__}: {e}"
        finally:
            client.close()
        outcome.answered_at, outcome.answer = time.monotonic(), answer
