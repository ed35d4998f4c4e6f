"""JSON schema keywords the grammar engine does not enforce, refused rather than dropped.

xgrammar (0.2.9) turns a schema into a grammar and passes over some keywords in silence: ``not``
and ``allOf`` of several schemas become "any JSON value" (``{"allOf": [{"type": "string"},
{"type": "integer"}]}`` answered ``null``), ``if``/``then``/``else``, ``contains``,
``uniqueItems`` and ``dependentSchemas``/``dependentRequired`` are left out of the grammar, and an
empty ``anyOf``/``oneOf`` (which nothing matches) became the empty text, and a ``$ref`` outside
the schema (a URL, a file) is neither fetched nor enforced: any JSON value passed. A robot that sent the
constraint would get output that breaks it, with nothing said. ``check_enforced`` refuses such a
schema, naming the keyword and where it is, so the team can write the constraint in a form that
is enforced (the one schema of an ``allOf`` merged, an ``enum`` for a ``not``), or check it in its
own code.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# keyword -> why it is refused (its value is any schema, or true for uniqueItems)
UNENFORCED = {
    "not": "is not enforced (any value would pass)",
    "if": "is not enforced (if/then/else are left out)",
    "contains": "is not enforced",
    "dependentSchemas": "is not enforced",
    "dependentRequired": "is not enforced",
}
_ONE_SCHEMA = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def check_enforced(schema: Any) -> None:
    """ValueError naming the first keyword of ``schema`` (or of a schema inside it) that the
    grammar would not enforce; what cannot be a schema is left to the converter's own errors."""
    for path, node in _schemas(schema, "schema"):
        for keyword, why in UNENFORCED.items():
            if keyword in node:
                raise ValueError(f"response_format {path}.{keyword} {why}: express it another way or check it "
                                 "after the answer")
        if isinstance(ref := node.get("$ref"), str) and ref != "#" and not ref.startswith("#/"):
            raise ValueError(f"response_format {path}.$ref {ref[:80]!r} is outside the schema: only references "
                             "into it ('#', '#/$defs/...') are followed, and nothing is fetched")
        if node.get("uniqueItems") is True:
            raise ValueError(f"response_format {path}.uniqueItems is not enforced: check it after the answer")
        if isinstance(all_of := node.get("allOf"), list) and len(all_of) > 1:
            raise ValueError(f"response_format {path}.allOf of {len(all_of)} schemas is not enforced (any value "
                             "would pass): merge them into one schema")
        for keyword in ("anyOf", "oneOf"):
            if node.get(keyword) == []:
                raise ValueError(f"response_format {path}.{keyword} is empty: no value could match it")


def _schemas(node: Any, path: str) -> Iterator[tuple[str, dict]]:
    """``node`` and every schema inside it, each with its path (``schema.properties.a.items``)."""
    stack = [(path, node)]
    while stack:
        path, node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield path, node
        for key in _ONE_SCHEMA:
            if isinstance(node.get(key), dict):
                stack.append((f"{path}.{key}", node[key]))
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend((f"{path}.{key}[{i}]", item) for i, item in enumerate(node[key]))
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((f"{path}.{key}.{name}", item) for name, item in node[key].items())
