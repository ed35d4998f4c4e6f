"""Bounds on what a ``response_format`` may ask of the grammar engine, checked before anything
is parsed or compiled.

A grammar's cost is paid on the engine's thread at every step (its token masks), and its
checks run in ``submit``: one small request must not stall every robot. Refused with a
ValueError naming the bound:

- any grammar's text longer than ``MAX_GRAMMAR_CHARS``;
- a JSON schema nested deeper than ``MAX_SCHEMA_DEPTH`` (objects and arrays of the document;
  700 levels had taken 12.8 s to validate);
- a regex whose counted repetitions, multiplied along their nesting, exceed ``MAX_REPETITION``
  (``(a{1,99}){1,99}`` is 9,801): each bound copies its pattern into the automaton, and a
  24-character nested repeat had made every step's mask fill take seconds. ``*``, ``+`` and
  ``?`` are loops, not copies, and count 1;
- a regex whose *nested* counted repetitions (a counted repetition of something that holds
  one) make more than ``MAX_NESTED_REPETITION`` copies: the copies of a variable-length inner
  repetition can split a text in many ways, and xgrammar's compile time grows with the square
  of the product (one thread: ``^([a-z ]{0,4}){0,4}$`` 0.2 s, ``{0,6}{0,6}`` 1.7 s,
  ``{0,8}{0,8}`` 8.8 s, ``{0,10}{0,10}`` 22 s, ``{0,30}{0,30}`` many minutes), while a flat
  ``[a-z ]{0,1000}`` compiles in 0.07 s;
- a JSON schema ``"pattern"`` whose counted repetitions exceed either bound the same
  way (a 30-character nested pattern had taken 89 s to compile);
- a JSON schema length keyword (``minLength``, ``maxLength``, ``minItems``, ``maxItems``,
  ``minProperties``, ``maxProperties``) above ``MAX_LENGTH_BOUND`` (4,096): each counted
  position is a state of the grammar, and no plan or robot answer needs more (a text longer
  than 4,096 characters is longer than any max_tokens the fleet asks for);
- an EBNF grammar of more than ``ebnf_limits.MAX_EBNF_RULES`` rules, whose counted
  repetitions exceed either bound along their nesting (through rule references too), or
  that puts two recursive rules side by side (``s ::= s s | "a"``: see
  ``shared.engine.grammar.ebnf_limits``);
- a skills plan of more than ``shared.plan.schema.MAX_SKILLS`` skills, refused by the plan
  format before its schema is built.

What passes may still be slow in ways no static check sees (ambiguity is undecidable); the
engine's per-request work budget (``shared.engine.request_budget``) ends such a request alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from shared.engine.grammar.ebnf_limits import EbnfShape

if TYPE_CHECKING:
    from shared.engine.grammar.response_format import GrammarSpec

MAX_GRAMMAR_CHARS = 65_536
MAX_SCHEMA_DEPTH = 32
MAX_REPETITION = 1_024
MAX_NESTED_REPETITION = 32
MAX_LENGTH_BOUND = 4_096
LENGTH_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")

_COUNTED = re.compile(r"\{(\d+)(,(\d*))?\}")


def check_grammar_limits(spec: "GrammarSpec") -> None:
    """ValueError naming the bound ``spec`` exceeds; nothing else is checked here."""
    if len(spec.source) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"response_format: a {spec.kind} of {len(spec.source)} characters exceeds "
                         f"{MAX_GRAMMAR_CHARS}")
    if spec.kind == "json_schema" and (depth := json_depth(spec.source)) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"response_format: the schema nests {depth} levels deep, more than {MAX_SCHEMA_DEPTH}")
    if spec.kind == "regex":
        _check_pattern(spec.source, "response_format.regex")
    if spec.kind == "json_schema":
        _check_schema_keywords(json.loads(spec.source))
    if spec.kind == "ebnf":
        EbnfShape.of(spec.source).check(MAX_REPETITION, MAX_NESTED_REPETITION)


def _check_pattern(pattern: str, where: str) -> None:
    copies, nested = repetition_products(pattern)
    if copies > MAX_REPETITION:
        raise ValueError(f"{where}: nested counted repetitions make {copies} copies, more than {MAX_REPETITION}")
    if nested > MAX_NESTED_REPETITION:
        raise ValueError(f"{where}: a counted repetition of a counted repetition makes {nested} copies, more "
                         f"than {MAX_NESTED_REPETITION} (each split of the text among them is compiled)")


def _check_schema_keywords(schema: Any) -> None:
    """ValueError for a ``pattern`` or a length keyword past its bound anywhere in ``schema``."""
    for node in _objects(schema):
        if isinstance(pattern := node.get("pattern"), str):
            _check_pattern(pattern, "response_format schema pattern")
        for keyword in LENGTH_KEYWORDS:
            bound = node.get(keyword)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool) and bound > MAX_LENGTH_BOUND:
                raise ValueError(f"response_format schema {keyword} {bound} is more than {MAX_LENGTH_BOUND}")


def _objects(value: Any) -> Iterator[dict]:
    """Every JSON object in ``value`` (the schema and each schema nested in it, and also
    ``properties`` maps and ``enum`` values: a keyword's bound is checked wherever it appears)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def json_depth(text: str) -> int:
    """The deepest nesting of objects and arrays in a JSON text (0 for a scalar)."""
    depth = deepest = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def repetition_product(pattern: str) -> int:
    """The largest product of counted-repetition bounds (``{n}``, ``{m,n}``; ``{m,}`` counts m)
    along any path of nested groups in ``pattern``; 1 without any."""
    return repetition_products(pattern)[0]


def repetition_products(pattern: str) -> tuple[int, int]:
    """``repetition_product`` and the largest product of a counted repetition applied to a
    group that holds one (``(a{3}){4}`` is 12; ``a{3}b{4}`` holds none: 1). One pass: each open
    group keeps the largest product found inside it, which its own repetition multiplies on
    close."""
    nested = 1
    inside = [1]  # per open group (and the whole pattern): the largest product within it
    last = 1  # the product of the atom or group just read, for a repetition that follows it
    i = 0
    while i < len(pattern):
        c = pattern[i]
        last_before, last = last, 1
        if c == "\\":
            i += 2
            continue
        if c == "[":  # a class: up to its closing bracket (a leading ] is a member)
            i += 2 if pattern[i + 1 : i + 2] == "]" else 1
            while i < len(pattern) and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
        elif c == "(":
            inside.append(1)
        elif c == ")" and len(inside) > 1:
            last = inside.pop()
            inside[-1] = max(inside[-1], last)
        elif c == "{" and (m := _COUNTED.match(pattern, i)):
            low, upper = int(m.group(1)), m.group(3)
            last = last_before * (int(upper) if upper else low)
            inside[-1] = max(inside[-1], last)
            if last_before > 1:
                nested = max(nested, last)
            i = m.end()
            continue
        i += 1
    return max(inside), nested
