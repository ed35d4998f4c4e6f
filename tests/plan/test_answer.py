"""An answer parsed once under its grammar: its plan, and whether it satisfies its schema."""

from __future__ import annotations

import json

from shared.engine.grammar.response_format import grammar_spec
from shared.plan import StructuredAnswer, plan_is_valid

SKILLS = [{"name": "undock", "description": "leave the dock", "args": {}},
          {"name": "goto", "description": "drive", "args": {"to": ["a", "bb"]}}]
PLAN = grammar_spec({"type": "skills", "skills": SKILLS, "max_steps": 2})
GOOD = {"steps": [{"skill": "goto", "args": {"to": "a"}}, {"skill": "undock", "args": {}}],
        "done": True, "confidence": 0.5}


def parsed(value, spec=PLAN) -> StructuredAnswer:
    return StructuredAnswer.parse(json.dumps(value), spec)


def test_a_plan_that_follows_the_schema_is_valid_and_is_its_own_plan():
    answer = parsed(GOOD)
    assert answer.is_valid and answer.plan == GOOD
    assert sorted(answer.strings()) == ["a", "goto", "undock"]


def test_text_that_is_not_json_has_no_plan_and_is_invalid():
    for text in ('{"steps": [', "Sure! Here is a plan", ""):
        answer = StructuredAnswer.parse(text, PLAN)
        assert answer.value is None and answer.plan is None and not answer.is_valid
    assert StructuredAnswer.parse("[" * 100_000, PLAN).value is None  # too deep to decode: not JSON


def test_a_wrong_shape_an_unknown_skill_or_too_many_steps_is_invalid_but_still_a_plan_object():
    wrong_shape = {**GOOD, "notes": "x"}
    unknown_skill = {**GOOD, "steps": [{"skill": "fly", "args": {}}]}
    too_many = {**GOOD, "steps": [{"skill": "undock", "args": {}}] * 3}
    for value in (wrong_shape, unknown_skill, too_many):
        answer = parsed(value)
        assert not answer.is_valid and answer.plan == value
    assert parsed([GOOD]).plan is None and not parsed([GOOD]).is_valid  # JSON, but not an object


def test_json_object_answers_parse_and_regex_answers_are_not_decoded():
    assert parsed({"x": 1}, grammar_spec({"type": "json_object"})).plan == {"x": 1}
    regex = StructuredAnswer.parse('{"x": 1}', grammar_spec({"type": "regex", "regex": ".+"}))
    assert regex.value is None and regex.plan is None and regex.is_valid
    assert plan_is_valid(json.dumps(GOOD), PLAN) and not plan_is_valid("not json", PLAN)
