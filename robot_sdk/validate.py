"""``PlanChecker``: the plan format's checks (``shared.plan.check``) as the SDK reports them.

Every answer is checked against the declared skills before any caller sees it; a ``BadPlan``
becomes an ``InvalidPlan`` carrying the request's id and the whole answer as ``text``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from robot_sdk.errors import InvalidPlan
from robot_sdk.skills import Skill
from shared.plan.check import BadPlan, CheckedPlan, PlanCheck, PlanStep

T = TypeVar("T")


class PlanChecker:
    """Validates whole plans, or steps one at a time while a plan streams (``PlanCheck``);
    raises ``InvalidPlan`` for ``request_id`` (set once the request has its id).

    ``skills`` None means a ``schema=`` request: the answer need only be a JSON object.
    """

    def __init__(self, skills: Sequence[Skill] | None, max_steps: int, request_id: str | None = None):
        self.check = PlanCheck(skills, max_steps)
        self.request_id = request_id

    def step(self, obj: Any, index: int, text: str) -> PlanStep | None:
        """Step ``index`` of the answer ``text`` so far (``PlanCheck.step``)."""
        return self._judged(text, lambda: self.check.step(obj, index))

    def plan(self, obj: Any, text: str) -> CheckedPlan:
        """The whole answer checked (``obj`` decoded from ``text``, or the daemon's parsed plan)."""
        return self._judged(text, lambda: self.check.plan(obj))

    def parse(self, text: str) -> CheckedPlan:
        """``text`` decoded as JSON and checked."""
        return self._judged(text, lambda: self.check.parse(text))

    def _judged(self, text: str, check: Callable[[], T]) -> T:
        try:
            return check()
        except BadPlan as e:
            raise InvalidPlan(str(e), self.request_id, text=text) from None
