"""How the hostile phase's victim sorts its plans' ends (fake clients: no daemon, no timing asserted)."""

from __future__ import annotations

import pytest

from robot_sdk.errors import InvalidPlan, Rejected
from robot_sdk.replies import PlanText
from soak.victim import Victim


class FakeClient:
    """A PlanClient whose every stream yields two text chunks, then ends in ``end``."""

    def __init__(self, end: Exception):
        self.end = end

    def stream(self, *args, **kwargs):
        yield PlanText("{", "cloud")
        yield PlanText('"steps"', "cloud")
        raise self.end

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("end", "answer", "refused", "lost"), [
    (Rejected("quota: over its rate", "amr-001/x"), "Rejected", True, False),
    (InvalidPlan("the model broke its skills", "amr-001/x"), "InvalidPlan", False, False),
    (RuntimeError("not a robot_sdk error"), "lost:RuntimeError: not a robot_sdk error", False, True),
])
def test_a_typed_refusal_counts_refused_the_models_invalid_plan_does_not_and_anything_else_is_lost(
        end, answer, refused, lost):
    window = Victim(lambda: FakeClient(end)).run(0.2)
    assert window.plans >= 1 and window.answers == {answer: window.plans}
    assert window.refused == (window.plans if refused else 0)
    assert window.lost == (window.plans if lost else 0)
    assert len(window.first_chunk_waits) == window.plans or len(window.first_chunk_waits) == window.plans - 1
    assert window.gaps  # between each plan's two chunks
