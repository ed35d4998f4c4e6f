"""response_format -> GrammarSpec for every kind, the skill-plan schema, and each error message."""

import json

import pytest

from shared.engine.grammar.response_format import FLEET_SKILLS, GrammarSpec, grammar_spec
from shared.plan.schema import FREE_TEXT_PATTERN, plan_schema

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}, "a": {"type": "string"}}}
GOTO = {"name": "goto", "description": "drive", "args": {"waypoint": "string", "speed": "number"}}
LIFT = {"name": "lift", "args": {"load": ["shelf", "pallet"], "height": "integer", "slow": "boolean"}}


def test_text_and_none_are_unconstrained():
    assert grammar_spec({"type": "text"}) is None
    assert grammar_spec(None) is None


def test_json_object():
    assert grammar_spec({"type": "json_object"}) == GrammarSpec("json_object", "")


def test_json_schema_both_shapes_give_one_hashable_spec():
    openai = grammar_spec({"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": SCHEMA}})
    flat = grammar_spec({"type": "json_schema", "schema": SCHEMA})
    assert openai == flat and hash(openai) == hash(flat) and len({openai, flat}) == 1
    # key order is kept: xgrammar emits properties in declared order
    assert openai.source == '{"type":"object","properties":{"x":{"type":"integer"},"a":{"type":"string"}}}'


def test_regex_and_ebnf_keep_their_text():
    assert grammar_spec({"type": "regex", "regex": "[0-9]+"}) == GrammarSpec("regex", "[0-9]+")
    assert grammar_spec({"type": "ebnf", "ebnf": 'root ::= "a"'}) == GrammarSpec("ebnf", 'root ::= "a"')


def test_skills_become_the_plan_schema():
    spec = grammar_spec({"type": "skills", "skills": [GOTO, LIFT], "max_steps": 3})
    assert spec.kind == "json_schema" and json.loads(spec.source) == plan_schema([GOTO, LIFT], 3)
    assert json.loads(grammar_spec({"type": "skills", "skills": [GOTO]}).source) == plan_schema([GOTO], 8)


def test_plan_schema_shape():
    schema = plan_schema([GOTO, LIFT], max_steps=3)
    assert list(schema["properties"]) == ["steps", "done", "confidence"]
    assert schema["required"] == ["steps", "done", "confidence"]
    assert schema["additionalProperties"] is False and schema["properties"]["done"] == {"type": "boolean"}
    assert schema["properties"]["confidence"] == {"type": "number", "minimum": 0, "maximum": 1}
    steps = schema["properties"]["steps"]
    assert (steps["minItems"], steps["maxItems"]) == (1, 3)
    goto, lift = steps["items"]["anyOf"]
    assert goto["properties"]["skill"] == {"const": "goto"} and goto["description"] == "drive"
    assert goto["required"] == ["skill", "args"] and goto["additionalProperties"] is False
    assert goto["properties"]["args"] == {
        "type": "object", "properties": {"waypoint": {"type": "string", "pattern": FREE_TEXT_PATTERN},
                                         "speed": {"type": "number", "minimum": -10000, "maximum": 10000}},
        "required": ["waypoint", "speed"], "additionalProperties": False}
    assert lift["properties"]["args"]["properties"] == {
        "load": {"type": "string", "enum": ["shelf", "pallet"]},
        "height": {"type": "integer", "minimum": -10000, "maximum": 10000}, "slow": {"type": "boolean"}}
    assert "description" not in lift


def test_fleet_skills_cover_both_robot_types():
    names = [skill["name"] for skill in FLEET_SKILLS]
    assert names == ["goto", "dock", "undock", "lift", "lower", "scan", "yield", "report",
                     "move_to", "look_at", "detect", "pick", "place", "open", "close", "hand_over", "wait",
                     "ask_human"]
    assert len(plan_schema(FLEET_SKILLS)["properties"]["steps"]["items"]["anyOf"]) == 18


@pytest.mark.parametrize("response_format, message", [
    ("json", r"response_format: expected an object, got str"),
    ({"type": "xml"}, r"response_format.type: unknown type 'xml'"),
    ({}, r"response_format.type: unknown type None"),
    ({"type": "json_schema"}, r"response_format.schema: missing"),
    ({"type": "json_schema", "json_schema": {"name": "p"}}, r"response_format.json_schema.schema: missing"),
    ({"type": "json_schema", "json_schema": "p"}, r"response_format.json_schema: expected an object"),
    ({"type": "json_schema", "schema": [1]}, r"response_format.schema: expected an object, got list"),
    ({"type": "json_schema", "schema": {"x": {1, 2}}}, r"schema is not plain JSON"),
    ({"type": "regex"}, r"response_format.regex: expected a non-empty string, got None"),
    ({"type": "ebnf", "ebnf": ""}, r"response_format.ebnf: expected a non-empty string"),
    ({"type": "skills"}, r"response_format.skills: expected a non-empty list"),
    ({"type": "skills", "skills": []}, r"response_format.skills: expected a non-empty list"),
    ({"type": "skills", "skills": [GOTO], "max_steps": 0}, r"response_format.max_steps: expected an integer >= 1"),
    ({"type": "skills", "skills": [GOTO], "max_steps": True}, r"response_format.max_steps"),
    ({"type": "skills", "skills": ["goto"]}, r"response_format.skills\[0\]: expected an object"),
    ({"type": "skills", "skills": [{"args": {}}]}, r"response_format.skills\[0\].name: expected a non-empty string"),
    ({"type": "skills", "skills": [{"name": "a", "arg": {}}]}, r"skills\[0\]: unknown keys \['arg'\]"),
    ({"type": "skills", "skills": [GOTO, GOTO]}, r"duplicate skill names \['goto'\]"),
    ({"type": "skills", "skills": [{"name": "a", "args": ["x"]}]}, r"skills\[0\].args: expected an object"),
    ({"type": "skills", "skills": [GOTO, {"name": "b", "args": {"v": "float"}}]},
     r"response_format.skills\[1\].args.v: bad argument type 'float'"),
    ({"type": "skills", "skills": [{"name": "b", "args": {"v": []}}]}, r"skills\[0\].args.v: bad argument type \[\]"),
    ({"type": "skills", "skills": [{"name": "b", "args": {"v": ["x", "x"]}}]}, r"args.v: bad argument type"),
    ({"type": "skills", "skills": [{"name": "b", "description": 3}]}, r"skills\[0\].description: expected a non-empty"),
])
def test_invalid_response_format_names_the_problem(response_format, message):
    with pytest.raises(ValueError, match=message):
        grammar_spec(response_format)


def test_unknown_spec_kind():
    with pytest.raises(ValueError, match="unknown grammar kind 'lark'"):
        GrammarSpec("lark", "start: x")
