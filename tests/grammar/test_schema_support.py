"""JSON schema keywords xgrammar would pass over in silence are refused, naming the keyword and
where it is (``shared.engine.grammar.schema_support``); what it enforces passes."""

from __future__ import annotations

import pytest

from shared.engine.grammar.build import parse_grammar
from shared.engine.grammar.response_format import FLEET_SKILLS, grammar_spec
from shared.engine.grammar.schema_support import check_enforced

STRING, INTEGER = {"type": "string"}, {"type": "integer"}


@pytest.mark.parametrize("schema, words", [
    ({"allOf": [STRING, INTEGER]}, "schema.allOf of 2 schemas is not enforced"),  # answered null before
    ({"not": {}}, "schema.not is not enforced"),
    ({"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}}},
     "schema.properties.a.not"),
    ({"anyOf": []}, "schema.anyOf is empty"),  # answered "" before
    ({"oneOf": []}, "schema.oneOf is empty"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "schema.if is not enforced"),
    ({"type": "array", "items": INTEGER, "contains": {"const": 3}}, "schema.contains"),
    ({"type": "array", "items": [{"type": "array", "uniqueItems": True}]}, "schema.items[0].uniqueItems"),
    ({"$defs": {"p": {"type": "object", "dependentRequired": {"a": ["b"]}}}, "$ref": "#/$defs/p"},
     "schema.$defs.p.dependentRequired"),
    ({"type": "object", "properties": {"a": {"$ref": "http://127.0.0.1:1/x.json"}}},
     "schema.properties.a.$ref 'http://127.0.0.1:1/x.json' is outside the schema"),  # re-fuzzing: any JSON passed
    ({"$ref": "file:///etc/passwd"}, "schema.$ref 'file:///etc/passwd' is outside"),
])
def test_an_unenforced_keyword_is_refused_where_it_is(schema, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("$", r"\$")):
        check_enforced(schema)


@pytest.mark.parametrize("schema", [
    {"allOf": [{"type": "object", "properties": {"a": STRING}}]},  # one schema: enforced
    {"type": "object", "properties": {"not": STRING, "if": INTEGER, "allOf": STRING}},  # property names
    {"anyOf": [STRING, INTEGER]},
    {"type": "array", "items": INTEGER, "uniqueItems": False},
    {"enum": ["a", "b"]},
    {"$ref": "#/$defs/a", "$defs": {"a": STRING}},
    {"type": "object", "properties": {"self": {"$ref": "#"}}},
])
def test_enforced_schemas_pass(schema):
    check_enforced(schema)


def test_the_fleet_plan_schema_passes_and_a_bad_one_is_refused_at_submit():
    parse_grammar(grammar_spec({"type": "skills", "skills": FLEET_SKILLS}))
    with pytest.raises(ValueError, match="allOf"):
        parse_grammar(grammar_spec({"type": "json_schema", "json_schema": {"schema": {"allOf": [STRING, INTEGER]}}}))
