"""Grammar bounds (``shared.engine.grammar.limits``): what would stall the engine for everyone is
refused at ``grammar_spec``, naming the bound, and ordinary grammars pass."""

from __future__ import annotations

import pytest

from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.grammar.limits import (MAX_LENGTH_BOUND, MAX_NESTED_REPETITION, MAX_REPETITION, json_depth,
                                          repetition_product, repetition_products)
from shared.plan.schema import MAX_SKILLS
from shared.engine.grammar.response_format import FLEET_SKILLS, grammar_spec
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import SchedulerConfig
from tests.engine.tiny import tiny_model


@pytest.mark.parametrize(("pattern", "copies"), [
    (r"(a{1,99}){1,99}", 99 * 99),
    (r"\d{1,3}(\.\d{1,3}){3}", 9),
    (r"((a{2}){3}){4}", 24),
    (r"(ab|cd){1,8}x{2}", 8),
    (r"a{5,}", 5),
    (r"[{]{3}", 3),  # a brace inside a class is a member
    (r"\{5}", 1),  # an escaped brace is a character
    (r"(a+)*b?", 1),  # loops, not copies
])
def test_repetition_product_multiplies_counted_bounds_along_their_nesting(pattern, copies):
    assert repetition_product(pattern) == copies


@pytest.mark.parametrize(("pattern", "nested"), [
    (r"([a-z ]{0,30}){0,30}", 900),
    (r"((a{2}){3}){4}", 24),
    (r"\d{1,3}(\.\d{1,3}){3}", 9),
    (r"[a-z ]{0,1000}", 1),  # flat: 0.07 s to compile
    (r"a{3}b{4}(cd){5}", 1),  # side by side, none inside another
    (r"([a-z ]?){0,200}", 1),  # a loop inside: 0.01 s to compile
])
def test_nested_repetition_product_counts_only_a_repetition_of_a_repetition(pattern, nested):
    assert repetition_products(pattern)[1] == nested


def test_a_nested_counted_repetition_is_refused_far_below_a_flat_one():
    """issue 48: ``^([a-z ]{0,30}){0,30}$`` (900, under the flat bound) compiled for minutes."""
    for response_format in (
        {"type": "json_schema", "schema": {"type": "string", "pattern": "^([a-z ]{0,30}){0,30}$"}},
        {"type": "regex", "regex": "([a-z ]{0,6}){0,6}"},
        {"type": "ebnf", "ebnf": 'root ::= (("a" | "b" | " "){0,30}){0,30}'},
        {"type": "ebnf", "ebnf": 'root ::= q{0,6}\nq ::= ("a"){0,6}'},  # through a reference
    ):
        with pytest.raises(ValueError, match=f"a counted repetition of a counted repetition makes [0-9]+ copies.* "
                                             f"more than {MAX_NESTED_REPETITION}"):
            grammar_spec(response_format)
    assert grammar_spec({"type": "regex", "regex": "[a-z ]{0,1000}"}) is not None
    assert grammar_spec({"type": "regex", "regex": "([a-z ]{0,4}){0,8}"}) is not None  # 32 copies: at the bound


def test_json_depth_counts_objects_and_arrays_but_not_brackets_in_strings():
    assert json_depth('{"a": [1, {"b": "[[[{{"}], "c": "\\"]"}') == 3
    assert json_depth("7") == 0


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize(("response_format", "words"), [
    ({"type": "regex", "regex": "(a{1,99}){1,99}"}, f"more than {MAX_REPETITION}"),
    ({"type": "json_schema", "schema": deep_schema(350)}, "nests"),  # 700 levels: 12.8 s to validate
    ({"type": "ebnf", "ebnf": 'root ::= "' + "a" * 70_000 + '"'}, "characters exceeds"),
    ({"type": "skills", "skills": [{"name": f"s{i}", "args": {}} for i in range(MAX_SKILLS + 1)]},
     f"more than {MAX_SKILLS}"),  # 2,000: 195 ms building its schema under the interpreter lock
], ids=["nested-repeat", "deep-schema", "long-ebnf", "many-skills"])
def test_a_grammar_past_its_bounds_is_refused_naming_the_bound(response_format, words):
    with pytest.raises(ValueError, match=words):
        grammar_spec(response_format)


def test_ordinary_grammars_pass():
    assert grammar_spec({"type": "skills", "skills": list(FLEET_SKILLS)}) is not None
    assert grammar_spec({"type": "regex", "regex": r"\d{1,3}(\.\d{1,3}){3}"}) is not None
    assert grammar_spec({"type": "json_schema", "schema": deep_schema(10)}) is not None


class _Spy:
    def __init__(self, wrapped):
        self.wrapped, self.calls = wrapped, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.wrapped(*args, **kwargs)


def test_a_refused_request_compiles_no_grammar(tokenizer):
    """Found in review: grammars of requests then refused were still compiled, on the one
    compile thread every constrained request waits for."""
    engine = Engine(tiny_model(vocab_size=tokenizer.vocab_size), tokenizer,
                    EngineConfig(block_size=4, num_blocks=64, scheduler=SchedulerConfig(max_model_len=16)))
    spy = engine.grammar_compiler.compile_async = _Spy(engine.grammar_compiler.compile_async)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.submit(list(range(1, 40)), SamplingParams(), response_format={"type": "json_object"})
    assert spy.calls == 0
    engine.submit([1, 2, 3], SamplingParams(max_tokens=2), response_format={"type": "json_object"})
    assert spy.calls == 1


def test_a_text_that_cannot_fit_is_refused_before_it_is_tokenized(tokenizer, monkeypatch):
    """Found in review: a 737 KB prompt was tokenized on the engine's thread (0.33 s each)
    before the length check refused it."""
    engine = Engine(tiny_model(vocab_size=tokenizer.vocab_size), tokenizer,
                    EngineConfig(block_size=4, num_blocks=64, scheduler=SchedulerConfig(max_model_len=64)))
    spy = _Spy(tokenizer.encode_chat)
    monkeypatch.setattr(tokenizer, "encode_chat", spy)  # the tokenizer is the session's
    with pytest.raises(ValueError, match="characters cannot fit"):
        engine.submit([{"role": "user", "content": "x" * 737_000}])
    assert spy.calls == 0


def nested_repeat(depth: int = 3) -> str:
    return "(" * depth + "a" + "){0,30}" * depth


AMBIGUOUS_EBNF = 'root ::= s\ns ::= s s | s s s | "a" | ""'  # the 361-byte grammar, its core


@pytest.mark.parametrize(("response_format", "words"), [
    ({"type": "ebnf", "ebnf": AMBIGUOUS_EBNF}, "recursive rules 's' and 's' side by side"),
    ({"type": "ebnf", "ebnf": 'root ::= s\ns ::= "a" s s | ""'}, "side by side"),
    ({"type": "ebnf", "ebnf": 'root ::= ((("a"){0,30}){0,30}){0,30}'},
     f"27000 copies in rule 'root', more than {MAX_REPETITION}"),
    ({"type": "ebnf", "ebnf": 'root ::= q{0,30}\nq ::= ("a"){0,40}'}, "1200 copies"),  # through a reference
    ({"type": "ebnf", "ebnf": "\n".join(f"r{i} ::= \"a\"" for i in range(1100)) + "\nroot ::= r0"},
     "more than 1024 rules"),
    ({"type": "json_schema", "schema": {"type": "string", "pattern": nested_repeat()}},
     f"schema pattern: nested counted repetitions make 27000 copies, more than {MAX_REPETITION}"),
    ({"type": "json_schema", "schema": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": nested_repeat()}}}}, "27000 copies"),
    ({"type": "json_schema", "schema": {"type": "string", "maxLength": 1_000_000}},
     f"maxLength 1000000 is more than {MAX_LENGTH_BOUND}"),
    ({"type": "json_schema", "schema": {"type": "array", "items": {"type": "string"}, "minItems": 5000}},
     "minItems 5000"),
], ids=["ambiguous-ebnf", "ambiguous-nullable-ebnf", "ebnf-nested-repeat", "ebnf-repeat-through-rules",
        "ebnf-many-rules", "schema-pattern", "nested-schema-pattern", "maxLength", "minItems"])
def test_every_grammar_kind_past_its_bounds_is_refused_naming_the_bound(response_format, words):
    with pytest.raises(ValueError, match=words):
        grammar_spec(response_format)


@pytest.mark.parametrize("ebnf", [
    'root ::= value\nvalue ::= "[" (value ("," value)*)? "]" | "1"',  # recursion with a separator
    'root ::= s\ns ::= "a" s | ""',  # one recursive reference per sequence
    'root ::= "x" b b\nb ::= "y"',  # side by side, but not recursive
    'root ::= ("ab"){2}("c"){0,512} # a comment: s s {0,9999}',
])
def test_ordinary_ebnf_passes(ebnf):
    assert grammar_spec({"type": "ebnf", "ebnf": ebnf}) is not None
