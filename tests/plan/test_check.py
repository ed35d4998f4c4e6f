"""A plan checked against declared skills names what is wrong (robot_sdk's ``PlanChecker``
reports these as ``InvalidPlan``; tests/sdk/test_validate.py covers every field)."""

from __future__ import annotations

import json

import pytest

from robot_sdk.skills import Skill
from shared.plan import BadPlan, PlanCheck, PlanStep

CHECK = PlanCheck((Skill.of("undock", "leave the dock"), Skill.of("goto", "drive", {"to": ["a", "bb"]})),
                  max_steps=2)
GOOD = {"steps": [{"skill": "goto", "args": {"to": "a"}}], "done": False, "confidence": 1}


def test_a_plan_over_the_skills_becomes_its_steps():
    checked = CHECK.parse(json.dumps(GOOD))
    assert checked.steps == (PlanStep("goto", {"to": "a"}),) and checked.done is False
    assert checked.confidence == 1.0 and checked.data == GOOD


@pytest.mark.parametrize("text, words", [
    ("Sure! Here is a plan", "the answer is not JSON"),
    ("[1, 2]", "the answer is not a JSON object: [1, 2]"),
    (json.dumps({**GOOD, "steps": "goto"}), '"steps" must be a non-empty list, got "goto"'),
    (json.dumps({**GOOD, "steps": [{"skill": "fly", "args": {}}]}), "unknown skill 'fly' (declared: undock, goto)"),
    (json.dumps({**GOOD, "steps": [{"skill": "undock", "args": {}}] * 3}), "step 2 "),
    (json.dumps({**GOOD, "steps": [{"skill": "undock", "args": {}}] * 3}), "more than max_steps=2 steps"),
    (json.dumps({**GOOD, "steps": [{"skill": "goto", "args": {"to": "c"}}]}), "argument 'to' = 'c' is not"),
])
def test_bad_input_is_a_bad_plan_naming_the_problem(text, words):
    with pytest.raises(BadPlan) as info:
        CHECK.parse(text)
    assert words in str(info.value)


def test_a_streamed_step_is_checked_alone_and_a_schema_request_reads_only_step_shaped_ones():
    assert CHECK.step({"skill": "undock", "args": {}}, 1) == PlanStep("undock", {})
    with pytest.raises(BadPlan, match="more than max_steps=2"):
        CHECK.step({"skill": "undock", "args": {}}, 2)
    free = PlanCheck(None, max_steps=8)
    assert free.step({"skill": "anything", "args": {}}, 0) == PlanStep("anything", {})
    assert free.step(3, 1) is None
