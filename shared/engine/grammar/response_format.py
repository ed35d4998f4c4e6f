"""The protocol's `response_format` as a hashable GrammarSpec, and the bundled fleet skill sets.

Accepted shapes (OpenAI's plus two of ours):

    {"type": "text"}                                              -> None (unconstrained)
    {"type": "json_object"}                                       -> any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}   (OpenAI)
    {"type": "json_schema", "schema": {...}}
    {"type": "regex", "regex": "..."}
    {"type": "ebnf", "ebnf": "..."}                               (root rule `root`)
    {"type": "skills", "skills": [{"name", "description", "args", "repeatable"}, ...], "max_steps": 8}

A skills plan's schema, its step budget, and how its answer is parsed and checked belong to
``shared.plan`` (``shared.plan.schema`` describes the plan form).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from shared.engine.grammar.limits import check_grammar_limits
from shared.engine.grammar.schema_support import check_enforced
from shared.plan.schema import DEFAULT_MAX_STEPS, nonempty_str, plan_schema

GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf"]
GRAMMAR_KINDS: tuple[GrammarKind, ...] = ("json_schema", "json_object", "regex", "ebnf")

# The skills of the bundled fleet traces (../shared/workloads/fleet.py), by robot type.
AMR_SKILLS: tuple[dict[str, Any], ...] = (
    {"name": "goto", "description": "drive to a named waypoint in the warehouse map",
     "args": {"waypoint": "string", "speed": "number"}},
    {"name": "dock", "description": "dock to a charging station or a conveyor",
     "args": {"station": "string", "kind": ["charger", "conveyor"]}},
    {"name": "undock", "description": "leave the current dock", "args": {}},
    {"name": "lift", "description": "lift the shelf or pallet under the robot",
     "args": {"load": ["shelf", "pallet"]}},
    {"name": "lower", "description": "lower the carried shelf or pallet", "args": {"location": "string"}},
    {"name": "scan", "description": "scan a barcode or fiducial at the current position",
     "args": {"target": ["barcode", "fiducial"]}},
    {"name": "yield", "description": "stop and let another robot or a person pass", "args": {"seconds": "number"}},
    {"name": "report", "description": "send a status message to the fleet manager",
     "args": {"status": ["ok", "failed", "blocked"], "message": "string"}},
)
MANIPULATOR_SKILLS: tuple[dict[str, Any], ...] = (
    {"name": "move_to", "description": "drive the base to a named location", "args": {"location": "string"}},
    {"name": "look_at", "description": "point the head camera at an object or location", "args": {"target": "string"}},
    {"name": "detect", "description": "run the object detector and report visible objects",
     "args": {"object": "string"}},
    {"name": "pick", "description": "grasp an object with the gripper; needs the object in reach",
     "args": {"object": "string", "grasp": ["normal", "gentle"]}},
    {"name": "place", "description": "put the held object at a location or on an object",
     "args": {"object": "string", "location": "string"}},
    {"name": "open", "description": "open a door, drawer or container", "args": {"target": "string"}},
    {"name": "close", "description": "close a door, drawer or container", "args": {"target": "string"}},
    {"name": "hand_over", "description": "give the held object to a person", "args": {"object": "string"}},
    {"name": "wait", "description": "pause for a number of seconds", "args": {"seconds": "number"}},
    {"name": "ask_human", "description": "ask the operator a yes/no question when unsure",
     "args": {"question": "string"}},
)
# NOTE: read-only by convention; the entries are plain dicts so the constant can travel inside a
# protocol message as `{"type": "skills", "skills": list(FLEET_SKILLS)}`.
FLEET_SKILLS: tuple[dict[str, Any], ...] = AMR_SKILLS + MANIPULATOR_SKILLS


@dataclass(frozen=True)
class GrammarSpec:
    """What a constrained output must match: a grammar `kind` and its `source` text.

    `source` is canonical, so equal specs hash equal and a spec is a cache key: a json_schema is
    compact JSON with its key order kept (xgrammar emits object properties in declared order, so
    reordering them is a different grammar); json_object has source ""; a regex or EBNF text is
    kept as given. Raises ValueError for an unknown kind.
    """

    kind: GrammarKind
    source: str
    # A skills plan: the skills that may repeat a step (shared.engine.grammar.repeat_guard); no
    # other step follows an identical one. None: not a plan (no guard). Not part of the key: the
    # compiled grammar is the same.
    repeatable: frozenset[str] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r} (expected one of {', '.join(GRAMMAR_KINDS)})")


def grammar_spec(response_format: Mapping[str, Any] | None) -> GrammarSpec | None:
    """The GrammarSpec a protocol/OpenAI `response_format` asks for; None when unconstrained.

    Raises ValueError naming the offending field for an unknown type, a missing or mistyped field,
    an invalid skill list, or a grammar past the bounds of ``shared.engine.grammar.limits``. It
    does not compile anything: a schema, regex or EBNF that xgrammar rejects surfaces from the
    compiler.
    """
    spec = _spec_of(response_format)
    if spec is not None:
        check_grammar_limits(spec)
    return spec


def _spec_of(response_format: Mapping[str, Any] | None) -> GrammarSpec | None:
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise ValueError(f"response_format: expected an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "")
    if kind == "json_schema":
        return GrammarSpec("json_schema", _canonical_json(_json_schema_of(response_format)))
    if kind in ("regex", "ebnf"):
        return GrammarSpec(kind, nonempty_str(response_format.get(kind), f"response_format.{kind}"))
    if kind == "skills":
        max_steps = response_format.get("max_steps", DEFAULT_MAX_STEPS)
        skills = response_format.get("skills")
        schema = plan_schema(skills, max_steps)  # checks the skills first
        return GrammarSpec("json_schema", _canonical_json(schema),
                           repeatable=frozenset(s["name"] for s in skills if s.get("repeatable") is True))
    raise ValueError(f"response_format.type: unknown type {kind!r} "
                     "(expected text, json_object, json_schema, regex, ebnf or skills)")


def _json_schema_of(response_format: Mapping[str, Any]) -> dict[str, Any]:
    """The schema of the OpenAI shape (`json_schema.schema`) or of the flat one (`schema`);
    ValueError for a keyword the grammar would not enforce (``schema_support``)."""
    if "json_schema" in response_format:
        wrapper = response_format["json_schema"]
        if not isinstance(wrapper, Mapping):
            raise ValueError("response_format.json_schema: expected an object with a schema")
        schema, where = wrapper.get("schema"), "response_format.json_schema.schema"
    else:
        schema, where = response_format.get("schema"), "response_format.schema"
    if schema is None:
        raise ValueError(f"{where}: missing")
    if not isinstance(schema, Mapping):
        raise ValueError(f"{where}: expected an object, got {type(schema).__name__}")
    check_enforced(schema)
    return dict(schema)


def _canonical_json(schema: Mapping[str, Any]) -> str:
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"response_format schema is not plain JSON: {exc}") from exc
    except RecursionError:
        raise ValueError("response_format schema is nested too deeply") from None


def fleet_plan_format() -> dict[str, Any]:
    """The response_format of a plan over the bundled fleet traces' skills ("fleet-plan")."""
    return {"type": "json_schema", "json_schema": {"name": "fleet-plan", "schema": plan_schema(FLEET_SKILLS)}}
