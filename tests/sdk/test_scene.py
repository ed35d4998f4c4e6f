"""Scene-grounded skills: a Scene's names become, per request, the only values of an argument
typed Place / Thing / Person (on the wire and in the checks), the scene message lists them and
the system prompt stays the same for every scene."""

from __future__ import annotations

import json

import pytest

from robot_sdk import InvalidPlan, PlanClient, PlanStep, Scene, Skill, skill
from robot_sdk.scene import Person, Place, Thing
from tests.sdk.fake_daemon import FakeDaemon, result


@skill
def goto(waypoint: Place) -> None:
    """drive to a named waypoint"""


@skill
def hand_over(item: Thing, to: Person) -> None:
    """give an object to a person"""


SKILLS = [goto, hand_over]
SCENE = Scene(places=("waypoint 17", "packing station"), objects=("tote 12",), people=("Ana",),
              notes="Battery 58 percent.")


def answer(plan: dict):
    return lambda request, attempt: [result(request, json.dumps(plan))]


def plan_of(*steps: dict) -> dict:
    return {"steps": list(steps), "done": True, "confidence": 0.9}


def test_a_grounded_request_sends_the_scenes_names_as_each_arguments_only_values():
    good = plan_of({"skill": "goto", "args": {"waypoint": "packing station"}},
                   {"skill": "hand_over", "args": {"item": "tote 12", "to": "Ana"}})
    with FakeDaemon(answer(good)) as daemon, PlanClient(daemon.endpoint) as client:
        plan = client.plan("Bring tote 12 to Ana.", scene=SCENE, skills=SKILLS)
    (sent,) = daemon.generates()
    assert sent.response_format["skills"] == [
        {"name": "goto", "description": "drive to a named waypoint",
         "args": {"waypoint": ["waypoint 17", "packing station"]}},
        {"name": "hand_over", "description": "give an object to a person",
         "args": {"item": ["tote 12"], "to": ["Ana"]}}]
    assert sent.messages[1].content == ("Scene: places: waypoint 17, packing station. objects: tote 12. "
                                        "people: Ana. Battery 58 percent.")
    assert "waypoint: a place named in the scene" in sent.messages[0].content
    assert plan.steps[1] == PlanStep("hand_over", {"item": "tote 12", "to": "Ana"})


def test_the_system_prompt_is_the_same_whatever_the_scene():
    other = Scene(places=("dock 1", "waypoint 17"), objects=("bin 4",), people=("Bo",))
    with FakeDaemon(answer(plan_of({"skill": "goto", "args": {"waypoint": "waypoint 17"}}))) as daemon, \
            PlanClient(daemon.endpoint) as client:
        client.plan("Go.", scene=SCENE, skills=SKILLS)
        client.plan("Go.", scene=other, skills=SKILLS)
    first, second = daemon.generates()
    assert first.messages[0] == second.messages[0]


def test_a_name_outside_the_scene_is_an_invalid_plan():
    """A daemon whose grammar did not enforce the scene (a schema from elsewhere): the check does."""
    wrong = plan_of({"skill": "goto", "args": {"waypoint": "waypoint 18"}})
    with FakeDaemon(answer(wrong)) as daemon, PlanClient(daemon.endpoint) as client:
        with pytest.raises(InvalidPlan, match="'waypoint 18' is not waypoint"):
            client.plan("Go.", scene=SCENE, skills=SKILLS)


def test_a_dict_scene_is_read_as_a_scene_for_grounded_skills():
    with FakeDaemon(answer(plan_of({"skill": "goto", "args": {"waypoint": "w1"}}))) as daemon, \
            PlanClient(daemon.endpoint) as client:
        client.plan("Go.", scene={"places": ["w1"], "objects": ["box"], "people": ["Cy"]}, skills=SKILLS)
    assert daemon.generates()[0].response_format["skills"][0]["args"] == {"waypoint": ["w1"]}


@pytest.mark.parametrize("scene, words", [
    (None, "no scene was given"),
    (Scene(places=("w1",)), "the scene has no objects"),
    ({"places": ["w1"], "robots": ["r2"]}, "unknown keys .'robots'."),
])
def test_a_scene_that_cannot_ground_the_skills_is_refused_before_sending(scene, words):
    with PlanClient("tcp://127.0.0.1:9") as client, pytest.raises(ValueError, match=words):
        client.plan("Go.", scene=scene, skills=SKILLS)


@pytest.mark.parametrize("fields, words", [
    ({"places": ("a", "a")}, "duplicate names"),
    ({"places": ('say "x"',)}, "is not a name"),
    ({"objects": ("",)}, "is not a name"),
    ({"people": (" Ana",)}, "is not a name"),
    ({"places": tuple(f"w{i}" for i in range(257))}, "more than 256"),
])
def test_bad_scene_names_are_refused_naming_the_field(fields, words):
    with pytest.raises(ValueError, match=words):
        Scene(**fields)


def test_plain_skill_kinds_name_scene_kinds_and_invoke_rebuilds_them():
    plain = Skill.of("goto", "drive", {"waypoint": "place"})
    assert plain.needs_scene and plain.grounded(Scene(places=("w1",))).to_wire()["args"] == {"waypoint": ["w1"]}
    with pytest.raises(ValueError, match="ground it"):
        plain.to_wire()
    called = Skill.from_callable(hand_over).grounded(SCENE)
    assert called.args[0].kind == ("tote 12",) and Skill.from_callable(hand_over).args[0].py_type is Thing
