"""A structured answer parsed once under its grammar, and checked against its schema.

``StructuredAnswer.parse(text, spec)`` decodes the JSON of a json_schema or json_object answer
(None: not JSON; a regex or EBNF answer is not decoded). Each tier parses its answer once and
reads everything from that: its ``plan`` (the JSON object a ``Result`` carries), whether it
``is_valid`` under the spec, the strings it says (edged's off-task rule).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # NOTE: response_format imports shared.plan.schema; this module needs only the type
    import jsonschema

    from shared.engine.grammar.response_format import GrammarSpec

JSON_KINDS = ("json_schema", "json_object")
SCHEMAS_CACHED = 128  # json_schema specs whose validator is kept: as GrammarCompiler's compiled grammars


@dataclass(frozen=True)
class StructuredAnswer:
    """An answer's text as decoded under ``spec``: ``value`` is its JSON, None when the text is
    not JSON or ``spec`` is not a JSON kind."""

    spec: GrammarSpec
    value: Any

    @classmethod
    def parse(cls, text: str, spec: GrammarSpec) -> StructuredAnswer:
        if spec.kind not in JSON_KINDS:
            return cls(spec, None)
        try:
            return cls(spec, json.loads(text))
        except (json.JSONDecodeError, RecursionError):  # NOTE: a json_object answer's depth is unbounded
            return cls(spec, None)

    @property
    def plan(self) -> dict | None:
        """The answer's JSON when it is an object (what a ``Result``'s ``plan`` carries), else None."""
        return self.value if isinstance(self.value, dict) else None

    @property
    def is_valid(self) -> bool:
        """Does the answer satisfy its spec? JSON kinds parse (and validate against the schema);
        regex and EBNF answers are complete exactly when the grammar accepted its end."""
        if self.spec.kind not in JSON_KINDS:
            return True
        if self.value is None:
            return False
        return self.spec.kind != "json_schema" or spec_schema(self.spec).validator.is_valid(self.value)

    def strings(self) -> Iterator[str]:
        """Every string value in the answer (not the keys of its objects), depth first."""
        return (v for v in _nodes(self.value) if isinstance(v, str))


def plan_is_valid(text: str, spec: GrammarSpec) -> bool:
    """Does ``text`` satisfy ``spec``? (``StructuredAnswer.is_valid`` of the text.)"""
    return StructuredAnswer.parse(text, spec).is_valid


@dataclass(frozen=True)
class SpecSchema:
    """What the checks need of a json_schema spec, derived once per spec (``spec_schema``)."""

    validator: jsonschema.protocols.Validator  # checked against its metaschema when built
    literals: frozenset[str]  # every const / enum string: the names an answer may use
    folded_literals: frozenset[str]  # the same, casefolded


@functools.lru_cache(maxsize=SCHEMAS_CACHED)
def spec_schema(spec: GrammarSpec) -> SpecSchema:
    """``spec``'s schema, parsed, checked and walked once: ``jsonschema.validate`` re-checks
    the schema on every call (~20 ms for a grounded plan's on the robot's CPU), once per local
    answer on edged's serve loop. Raises ``jsonschema.SchemaError`` (not cached)."""
    import jsonschema  # NOTE: not at the top: robot_sdk imports shared.plan, never validates (~80 ms)

    schema = json.loads(spec.source)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    literals = frozenset(_literals(schema))
    return SpecSchema(cls(schema), literals, frozenset(name.casefold() for name in literals))


def _literals(schema: object) -> Iterator[str]:
    """Every string a JSON schema allows by ``const`` or ``enum``, anywhere in it."""
    for node in _nodes(schema):
        if isinstance(node, dict):
            const, enum = node.get("const"), node.get("enum")
            yield from [const] if isinstance(const, str) else []
            yield from (v for v in enum if isinstance(v, str)) if isinstance(enum, list) else []


def _nodes(value: object) -> Iterator[object]:
    """A JSON value and every value inside it, depth first (not the keys of its objects)."""
    yield value
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for child in children:
        yield from _nodes(child)
