"""Grammars with a rule that can never finish are refused (``shared.engine.grammar.termination``),
on xgrammar's printed form of EBNF, JSON schemas and regexes; grammars that can finish pass."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from shared.engine.grammar.response_format import FLEET_SKILLS, grammar_spec
from shared.engine.grammar.build import parse_grammar
from shared.engine.grammar.termination import check_rules_finish


def _schema(schema: dict) -> str:
    return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True))


def _ebnf(text: str) -> str:
    return str(xgr.Grammar.from_ebnf(text))


SELF = {"$ref": "#"}


@pytest.mark.parametrize("printed, rule", [
    (_ebnf('root ::= "a" root'), "root"),
    (_ebnf('root ::= "(" root ")"'), "root"),
    (_ebnf('root ::= rest+\nrest ::= "a" rest'), "root"),
    # the root can finish, but a rule output can enter cannot: a trap
    (_ebnf('root ::= "x" | "y" rest\nrest ::= "a" rest'), "rest"),
    (_ebnf('root ::= rest* "x"\nrest ::= "a" rest'), "rest"),
    (_ebnf('root ::= a\na ::= "x" b\nb ::= "y" a'), "root"),  # through another rule
    # reached through what may be taken zero times (found re-fuzzing: a{0,3} hid 'a', and the daemon ran out of memory)
    (_ebnf('root ::= a{0,3}\na ::= "b" a'), "a"),
    (_ebnf('root ::= "x" a{0,}\na ::= "b" a'), "a"),
    (_ebnf('root ::= "x" ("b" a){0,2} "y"\na ::= "c" a'), "(root_1|a)"),  # the group is a rule of its own
    (_ebnf('root ::= "x" (= a)\na ::= "c" a'), "a"),  # through a lookahead
    (_ebnf('root ::= TagDispatch(("<go>", go), loop_after_dispatch=false)\ngo ::= "x" go'), "go"),  # a dispatch target
    (_schema({"type": "object", "properties": {"a": SELF}, "required": ["a"]}), "root"),
    (_schema({"type": "array", "items": SELF, "minItems": 1}), "root"),
    (_schema({"$defs": {"n": {"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}}, "required": ["x"]}},
              "$ref": "#/$defs/n"}), "root"),
])
def test_a_rule_that_can_never_finish_is_refused_by_name(printed, rule):
    with pytest.raises(ValueError, match=f"rule '{rule}' can never finish"):
        check_rules_finish(printed)


@pytest.mark.parametrize("printed", [
    _ebnf('root ::= "a" root | ""'),
    _ebnf('root ::= "(" root ")" | "x"'),
    _ebnf('root ::= "b"{0,3} "x"'),
    _ebnf('root ::= "a" rest (= "b")\nrest ::= "b"'),  # a lookahead reads nothing
    _ebnf('root ::= "x"\nunused ::= "a" unused'),  # unreachable: never entered
    _schema({"type": "object", "properties": {"a": SELF}}),  # optional: may stop
    _schema({"type": "array", "items": SELF}),  # may be empty
    _schema({"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-z]{2,5}$"}}, "required": ["s"]}),
    _schema({"anyOf": [{"type": "integer"}, {"type": "null"}]}),
    str(xgr.Grammar.from_regex(r"[a-z]{2,5}(x|y)+\d*")),
    str(xgr.Grammar.builtin_json_grammar()),
    _ebnf('root ::= Regex("[a-z]+") Token(5)'),
    _ebnf('root ::= TagDispatch(("<go>", go), loop_after_dispatch=true)\ngo ::= "x" | go "y"'),
])
def test_grammars_that_can_finish_pass(printed):
    check_rules_finish(printed)


def test_the_fleet_plan_grammars_pass_as_parsed():
    for response_format in ({"type": "json_object"}, {"type": "skills", "skills": FLEET_SKILLS},
                            {"type": "regex", "regex": "(pick|place) [a-z]+"}):
        parse_grammar(grammar_spec(response_format))


def test_a_printed_form_it_cannot_read_is_an_error_not_a_pass():
    for printed in ('root ::= ("a" | "b"', "root = \"a\"", 'root ::= "a" @', 'root ::= Frobnicate("a")'):
        with pytest.raises(ValueError, match="unreadable"):
            check_rules_finish(printed)
