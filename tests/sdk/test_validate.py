"""Plans are checked against the declared skills: the checker agrees with the daemon's plan
schema (less its length bounds) and its errors quote the offending step."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from robot_sdk import InvalidPlan, PlanStep, Skill
from robot_sdk.validate import PlanChecker
from shared.plan.schema import plan_schema

SKILLS = (
    Skill.of("goto", "drive to a waypoint", {"waypoint": "string", "speed": "number"}),
    Skill.of("dock", "dock", {"kind": ["charger", "conveyor"], "retries": "integer", "force": "boolean"}),
    Skill.of("undock", "leave the dock"),
)
CHECKER = PlanChecker(SKILLS, max_steps=3)


def good_plan() -> dict:
    return {"steps": [{"skill": "goto", "args": {"waypoint": "w1", "speed": 1}},
                      {"skill": "dock", "args": {"kind": "charger", "retries": 2, "force": False}},
                      {"skill": "undock", "args": {}}],
            "done": True, "confidence": 0.5}


def test_a_valid_plan_becomes_steps_done_and_confidence():
    checked = CHECKER.parse(json.dumps(good_plan()))
    assert checked.steps == (PlanStep("goto", {"waypoint": "w1", "speed": 1}),
                             PlanStep("dock", {"kind": "charger", "retries": 2, "force": False}),
                             PlanStep("undock", {}))
    assert checked.done is True and checked.confidence == 0.5


@pytest.mark.parametrize("edit, words", [
    (lambda p: p["steps"][1].update(skill="fly"), "step 1 {\"skill\": \"fly\""),
    (lambda p: p["steps"][1].update(skill="fly"), "unknown skill 'fly' (declared: goto, dock, undock)"),
    (lambda p: p["steps"][0]["args"].pop("speed"), "missing ['speed'], unexpected []"),
    (lambda p: p["steps"][2]["args"].update(now=True), "missing [], unexpected ['now']"),
    (lambda p: p["steps"][0]["args"].update(speed="fast"), "argument 'speed' = 'fast' is not speed: number"),
    (lambda p: p["steps"][1]["args"].update(retries=2.5), "argument 'retries' = 2.5 is not retries: integer"),
    (lambda p: p["steps"][1]["args"].update(retries=True), "argument 'retries' = True"),
    (lambda p: p["steps"][1]["args"].update(force=0), "argument 'force' = 0 is not force: boolean"),
    (lambda p: p["steps"][1]["args"].update(kind="wall"), 'is not kind: "charger" | "conveyor"'),
    (lambda p: p["steps"][0].update(why="because"), 'exactly "skill" and "args"'),
    (lambda p: p["steps"].append({"skill": "undock", "args": {}}), "more than max_steps=3"),
    (lambda p: p.update(steps=[]), '"steps" must be a non-empty list'),
    (lambda p: p.pop("done"), '"done" must be true or false'),
    (lambda p: p.update(confidence=1.5), '"confidence" must be a number from 0 to 1, got 1.5'),
    (lambda p: p.update(notes="x"), "unexpected keys ['notes']"),
])
def test_each_way_to_break_the_skills_is_an_invalid_plan_quoting_it(edit, words):
    plan = good_plan()
    edit(plan)
    text = json.dumps(plan)
    with pytest.raises(InvalidPlan) as info:
        CHECKER.parse(text)
    assert words in info.value.message and info.value.text == text


def test_text_that_is_not_a_json_object_is_an_invalid_plan():
    for text in ('{"steps": [', "[1, 2]", "Sure! Here is a plan"):
        with pytest.raises(InvalidPlan) as info:
            CHECKER.parse(text)
        assert info.value.text == text


def test_a_schema_answer_keeps_its_data_and_reads_steps_only_when_they_have_the_step_form():
    checker = PlanChecker(None, max_steps=8)
    checked = checker.parse('{"target": "cup", "steps": [{"skill": "x", "args": {}}, 3], "confidence": 0.9}')
    assert checked.data["target"] == "cup" and checked.steps == (PlanStep("x", {}),)
    assert checked.done is False and checked.confidence == 0.9
    assert checker.parse('{"target": "cup"}').steps == ()
    with pytest.raises(InvalidPlan):
        checker.parse('"cup"')


# --- the checker against the daemon's schema ---------------------------------------------

GOOD_STEPS = [{"skill": "goto", "args": {"waypoint": "w1", "speed": 0.5}},
              {"skill": "dock", "args": {"kind": "conveyor", "retries": 2, "force": True}},
              {"skill": "undock", "args": {}}]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(-5, 5, allow_nan=False),
                   st.sampled_from([2.0, "charger", "conveyor", "w1", ""]))
ARG_NAMES = st.sampled_from(["waypoint", "speed", "kind", "retries", "force", "other"])


@st.composite
def steps(draw) -> dict:
    """A valid step, then maybe one edit: a changed or extra argument, a lost one, another skill."""
    step = json.loads(json.dumps(draw(st.sampled_from(GOOD_STEPS))))
    edit = draw(st.sampled_from(["none"] * 8 + ["set", "drop", "skill", "key"]))
    if edit == "set":
        step["args"][draw(ARG_NAMES)] = draw(VALUES)
    elif edit == "drop" and step["args"]:
        step["args"].pop(draw(st.sampled_from(sorted(step["args"]))))
    elif edit == "skill":
        step["skill"] = draw(st.sampled_from(["goto", "dock", "undock", "fly"]))
    elif edit == "key":
        step["why"] = "x"
    return step


@st.composite
def plans(draw) -> dict:
    """Mostly valid plans, each with a chance of one broken step or field."""
    plan = {"steps": draw(st.lists(steps(), min_size=0 if draw(st.integers(0, 9)) == 0 else 1, max_size=4)),
            "done": draw(st.sampled_from([True, False, True, False, 1])),
            "confidence": draw(st.one_of(st.floats(0, 1), st.floats(0, 1), st.floats(-1, 2), st.just(True)))}
    drop = draw(st.sampled_from([None] * 8 + ["done", "confidence"]))
    if drop:
        del plan[drop]
    if draw(st.integers(0, 9)) == 0:
        plan["extra"] = 0
    return plan


@settings(max_examples=400, deadline=None)
@given(plans())
def test_the_checker_accepts_exactly_what_the_daemon_s_plan_schema_accepts(plan):
    schema = plan_schema([s.to_wire() for s in SKILLS], max_steps=3)
    schema_ok = jsonschema.Draft202012Validator(schema).is_valid(plan)
    try:
        CHECKER.plan(plan, json.dumps(plan))
        checker_ok = True
    except InvalidPlan:
        checker_ok = False
    assert checker_ok == schema_ok


def test_an_integral_float_is_an_integer_as_in_json_schema_and_reaches_the_skill_as_an_int():
    plan = good_plan()
    plan["steps"][1]["args"]["retries"] = 2.0
    step = CHECKER.parse(json.dumps(plan)).steps[1]
    assert step.args["retries"] == 2
