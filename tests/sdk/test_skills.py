"""Skills declared as functions and dataclasses become the daemon's skill format exactly, the
prompt's skill list, and callables for plan steps."""

from __future__ import annotations

import dataclasses
import enum
from typing import Literal

import pytest

from robot_sdk import Skill, skill
from robot_sdk.prompt import plan_messages, response_format, system_prompt
from robot_sdk.skills import as_skills
from shared.engine.grammar.response_format import MANIPULATOR_SKILLS, grammar_spec
from shared.plan.schema import plan_schema


class Grasp(enum.Enum):
    NORMAL = "normal"
    GENTLE = "gentle"


@skill
def pick(object: str, grasp: Grasp) -> str:
    """Grasp an object with the gripper; needs the object in reach.

    This second paragraph is for humans, not for the prompt.
    """
    return f"picked {object} ({grasp.name})"


@skill(name="wait", description="pause for a number of seconds")
def wait_seconds(seconds: float) -> float:
    return seconds


@skill
@dataclasses.dataclass
class MoveTo:
    """drive the base to a named location"""

    location: str


@dataclasses.dataclass
class SetGripper:
    """open or close the gripper to a width"""

    width_mm: int
    close: bool
    mode: Literal["fast", "slow"]
    attempts: int = dataclasses.field(default=0, init=False)


def test_a_function_a_literal_an_enum_and_a_dataclass_give_the_daemon_s_skill_entries():
    skills = as_skills([pick, wait_seconds, MoveTo, SetGripper])
    assert [s.to_wire() for s in skills] == [
        {"name": "pick", "description": "Grasp an object with the gripper; needs the object in reach.",
         "args": {"object": "string", "grasp": ["normal", "gentle"]}},
        {"name": "wait", "description": "pause for a number of seconds", "args": {"seconds": "number"}},
        {"name": "move_to", "description": "drive the base to a named location", "args": {"location": "string"}},
        {"name": "set_gripper", "description": "open or close the gripper to a width",
         "args": {"width_mm": "integer", "close": "boolean", "mode": ["fast", "slow"]}},
    ]


def test_declared_skills_reproduce_the_bundled_manipulator_skills_schema():
    """The SDK's declarations yield exactly the server's plan schema for the fleet's skills."""
    declared = [Skill.of(s["name"], s["description"], s["args"]) for s in MANIPULATOR_SKILLS]
    rf = response_format(declared, None, 8)
    assert rf == {"type": "skills", "skills": list(MANIPULATOR_SKILLS), "max_steps": 8}
    assert grammar_spec(rf) == grammar_spec({"type": "json_schema", "schema": plan_schema(MANIPULATOR_SKILLS)})


def test_a_decorated_function_stays_callable_and_invoke_rebuilds_enums():
    assert pick("cup", Grasp.GENTLE) == "picked cup (GENTLE)"
    step_args = {"object": "cup", "grasp": "gentle"}
    assert pick.__fleet_skill__.invoke(step_args) == "picked cup (GENTLE)"
    assert as_skills([MoveTo])[0].invoke({"location": "sink"}) == MoveTo("sink")
    assert as_skills([wait_seconds])[0].invoke({"seconds": 2}) == 2.0
    assert isinstance(as_skills([wait_seconds])[0].invoke({"seconds": 2}), float)


@pytest.mark.parametrize("declare, words", [
    (lambda: skill(lambda x: None), "no type hint"),
    (lambda: Skill.from_callable(_undocumented), "needs a description"),
    (lambda: Skill.from_callable(_list_arg), "has type list[str]"),
    (lambda: Skill.from_callable(_int_literal), "Literal must list distinct strings"),
    (lambda: Skill.from_callable(_var_args), "*args/**kwargs"),
    (lambda: Skill.of("goto", "drive", {"speed": "fast"}), "argument 'speed' has kind 'fast'"),
    (lambda: Skill.of("go to", "drive"), "expected an identifier"),
    (lambda: as_skills([pick, pick]), "duplicate skill names ['pick']"),
    (lambda: as_skills([]), "the list is empty"),
    (lambda: as_skills("pick"), "expected a list of skills"),
])
def test_bad_declarations_fail_at_declaration_naming_the_skill_and_argument(declare, words):
    with pytest.raises((TypeError, ValueError)) as info:
        declare()
    assert words in str(info.value)


def _undocumented(x: str) -> None:
    pass


def _list_arg(items: list[str]) -> None:
    """takes a list"""


def _int_literal(level: Literal[1, 2]) -> None:
    """takes a level"""


def _var_args(*targets: str) -> None:
    """takes many"""


def test_the_system_prompt_lists_each_skill_with_its_arguments_and_asks_for_the_plan_json():
    skills = as_skills([pick, wait_seconds])
    prompt = system_prompt(skills, None, 3, instructions="Never drive through people.")
    lines = prompt.splitlines()
    assert ('- pick(object: string, grasp: "normal" | "gentle"): '
            'Grasp an object with the gripper; needs the object in reach.') in lines
    assert "- wait(seconds: number): pause for a number of seconds" in lines
    assert "Never drive through people." in lines
    assert '{"steps": [{"skill": <one of the skills>, "args": {<argument name>: <value>}}]' in prompt
    assert prompt.endswith("Use at most 3 steps.")
    schema_prompt = system_prompt(None, {"type": "object"}, 8)
    assert schema_prompt.endswith('matching this JSON schema: {"type":"object"}')


def test_plan_messages_put_the_scene_before_the_task_and_keep_the_system_prompt_task_free():
    messages = plan_messages(" Bring the cup. ", {"cup": "table", "battery": 80}, "SYSTEM")
    assert messages == ({"role": "system", "content": "SYSTEM"},
                        {"role": "user", "content": 'Scene: {"battery": 80, "cup": "table"}'},
                        {"role": "user", "content": "Task: Bring the cup."})
    assert len(plan_messages("go", None, "SYSTEM")) == 2
    with pytest.raises(ValueError, match="task"):
        plan_messages("  ", None, "SYSTEM")
    with pytest.raises(TypeError, match="scene"):
        plan_messages("go", 42, "SYSTEM")


def test_a_schema_request_sends_a_json_schema_format():
    schema = {"type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"]}
    expected = {"type": "json_schema", "json_schema": {"name": "plan", "schema": schema}}
    assert response_format(None, schema, 8) == expected
    with pytest.raises(ValueError, match="not plain JSON"):
        response_format(None, {"default": object()}, 8)
