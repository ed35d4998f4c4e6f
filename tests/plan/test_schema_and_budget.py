"""A plan's schema from a skill set, and the tokens a plan of N steps can take, with tiny skills:
``undock()`` (31 bytes a step) and ``goto(to: "a" | "bb", fast: boolean)`` (54 at its longest)."""

from __future__ import annotations

import pytest

from robot_sdk.skills import Skill
from shared.plan import DEFAULT_MAX_STEPS, max_plan_tokens, plan_schema, steps_that_fit

UNDOCK = Skill.of("undock", "leave the dock")
GOTO = Skill.of("goto", "drive", {"to": ["a", "bb"], "fast": "boolean"})
FRAME = len('{"steps": [], "done": false, "confidence": }') + len("0.000000")  # 52 bytes


def test_the_schema_bounds_the_steps_and_fixes_each_steps_skill():
    schema = plan_schema([UNDOCK.to_wire(), GOTO.to_wire()], max_steps=2)
    steps = schema["properties"]["steps"]
    assert (steps["minItems"], steps["maxItems"]) == (1, 2)
    assert [b["properties"]["skill"] for b in steps["items"]["anyOf"]] == [{"const": "undock"}, {"const": "goto"}]
    assert schema["required"] == ["steps", "done", "confidence"] and schema["additionalProperties"] is False
    assert plan_schema([UNDOCK.to_wire()])["properties"]["steps"]["maxItems"] == DEFAULT_MAX_STEPS == 8


@pytest.mark.parametrize("skills, max_steps, words", [
    ([], 8, "non-empty list of skills"),
    ([{"name": "x", "description": "d", "args": {}}] * 2, 8, "duplicate skill names ['x']"),
    ([{"name": "x", "description": "d", "args": {"a": "date"}}], 8, "bad argument type 'date'"),
    ([{"name": "x", "description": "d", "flavour": 1}], 8, "unknown keys ['flavour']"),
    ([{"name": "x", "description": "d"}], 0, "max_steps: expected an integer >= 1"),
])
def test_a_bad_skill_set_is_refused_naming_the_field(skills, max_steps, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        plan_schema(skills, max_steps)


def test_the_budget_is_the_frame_plus_the_longest_step_per_step_plus_separators_and_the_end_token():
    assert max_plan_tokens([UNDOCK], 1) == FRAME + 31 + 1 == 84
    assert max_plan_tokens([UNDOCK], 2) == FRAME + 2 * 31 + len(", ") + 1 == 117
    assert max_plan_tokens([UNDOCK, GOTO], 1) == FRAME + 54 + 1 == 107


def test_steps_that_fit_lowers_the_step_bound_to_the_budget_or_refuses():
    assert steps_that_fit([UNDOCK], 8, 117) == 2
    assert steps_that_fit([UNDOCK], 8, 116) == 1
    assert steps_that_fit([UNDOCK], 8, 10_000) == 8
    with pytest.raises(ValueError, match="max_tokens=83 cannot hold a complete plan: one step of these skills "
                                         "can take 84 tokens"):
        steps_that_fit([UNDOCK], 8, 83)


def test_an_argument_not_grounded_in_a_scene_has_no_bound():
    with pytest.raises(ValueError, match="argument 'to': ground it in a scene"):
        max_plan_tokens([Skill.of("goto", "drive", {"to": "place"})], 1)
