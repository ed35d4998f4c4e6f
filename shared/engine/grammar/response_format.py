"""The protocol's `response_format` as a hashable GrammarSpec, and the JSON schema of a skill plan.

Accepted shapes (OpenAI's plus two of ours):

    {"type": "text"}                                              -> None (unconstrained)
    {"type": "json_object"}                                       -> any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}   (OpenAI)
    {"type": "json_schema", "schema": {...}}
    {"type": "regex", "regex": "..."}
    {"type": "ebnf", "ebnf": "..."}                               (root rule `root`)
    {"type": "skills", "skills": [{"name", "description", "args", "repeatable"}, ...], "max_steps": 8}

A skill's `args` maps an argument name to "string" | "number" | "integer" | "boolean" or to a
list of strings (an enum). A skill plan is `{"steps": [{"skill": <name>, "args": {...}}, ...],
"done": <bool>, "confidence": <0..1>}` (the form the fleet prompts ask for); every argument is
required and no other key is allowed. No step may follow an identical one (same skill, same
arguments) unless its skill says `"repeatable": true` (`shared.engine.grammar.repeat_guard`).
Values are bounded so a plan always ends: numbers within +-`MAX_NUMBER`; a free-text string (a
report's message) is `FREE_TEXT_PATTERN`: a letter, then at most `MAX_STRING_CHARS` - 1
letters, digits, spaces and plain punctuation (no control characters, quotes, backslashes,
braces or brackets a runaway model loops on; starting with a letter took the default model's
report messages from "20180111111221333.1.1.1" to "The aisle 4 is blocked."). An enum
(a list of strings: a scene's place names, say) allows exactly its values.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from shared.engine.grammar.limits import MAX_SKILLS, check_grammar_limits

GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf"]
GRAMMAR_KINDS: tuple[GrammarKind, ...] = ("json_schema", "json_object", "regex", "ebnf")

DEFAULT_MAX_STEPS = 8  # the fleet prompts' "at most 8 steps"
ARG_TYPES = ("string", "number", "integer", "boolean")
MAX_STRING_CHARS = 32
FREE_TEXT_PATTERN = f"^[A-Za-z][A-Za-z0-9 .,;:!?'()/_-]{{0,{MAX_STRING_CHARS - 1}}}$"
MAX_NUMBER = 10_000

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
        return GrammarSpec(kind, _nonempty_str(response_format.get(kind), f"response_format.{kind}"))
    if kind == "skills":
        max_steps = response_format.get("max_steps", DEFAULT_MAX_STEPS)
        skills = response_format.get("skills")
        schema = plan_schema(skills, max_steps)  # checks the skills first
        return GrammarSpec("json_schema", _canonical_json(schema),
                           repeatable=frozenset(s["name"] for s in skills if s.get("repeatable") is True))
    raise ValueError(f"response_format.type: unknown type {kind!r} "
                     "(expected text, json_object, json_schema, regex, ebnf or skills)")


def plan_schema(skills: Sequence[Mapping[str, Any]], max_steps: int = DEFAULT_MAX_STEPS) -> dict[str, Any]:
    """The JSON schema of a plan of 1..`max_steps` steps over `skills` (see the module docstring).

    Each step is an anyOf over the skills, each branch fixing `skill` by `const`, so the grammar
    only allows a skill's own arguments after its name. Raises ValueError for an empty or
    malformed skill list, a duplicate skill name, an unknown argument type or a bad `max_steps`.
    """
    if not isinstance(skills, Sequence) or isinstance(skills, str) or not skills:
        raise ValueError("response_format.skills: expected a non-empty list of skills")
    if len(skills) > MAX_SKILLS:
        raise ValueError(f"response_format.skills: {len(skills)} skills, more than {MAX_SKILLS}")
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"response_format.max_steps: expected an integer >= 1, got {max_steps!r}")
    steps = [_step_schema(skill, f"response_format.skills[{i}]") for i, skill in enumerate(skills)]
    names = [step["properties"]["skill"]["const"] for step in steps]
    duplicates = sorted(name for name, n in Counter(names).items() if n > 1)
    if duplicates:
        raise ValueError(f"response_format.skills: duplicate skill names {duplicates}")
    return {
        "type": "object",
        "properties": {
            "steps": {"type": "array", "items": {"anyOf": steps}, "minItems": 1, "maxItems": max_steps},
            "done": {"type": "boolean"},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["steps", "done", "confidence"],
        "additionalProperties": False,
    }


def _step_schema(skill: Any, where: str) -> dict[str, Any]:
    if not isinstance(skill, Mapping):
        raise ValueError(f"{where}: expected an object with name, description and args")
    unknown = sorted(set(skill) - {"name", "description", "args", "repeatable"})
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (expected name, description, args, repeatable)")
    if not isinstance(skill.get("repeatable", False), bool):
        raise ValueError(f"{where}.repeatable: expected true or false")
    name = _nonempty_str(skill.get("name"), f"{where}.name")
    args = skill.get("args", {})
    if not isinstance(args, Mapping):
        raise ValueError(f"{where}.args: expected an object mapping argument names to types")
    properties = {_nonempty_str(arg, f"{where}.args key"): _arg_schema(kind, f"{where}.args.{arg}")
                  for arg, kind in args.items()}
    step: dict[str, Any] = {
        "type": "object",
        "properties": {
            "skill": {"const": name},
            "args": {"type": "object", "properties": properties, "required": list(properties),
                     "additionalProperties": False},
        },
        "required": ["skill", "args"],
        "additionalProperties": False,
    }
    if "description" in skill:
        step["description"] = _nonempty_str(skill["description"], f"{where}.description")
    return step


def _arg_schema(kind: Any, where: str) -> dict[str, Any]:
    if kind == "string":
        return {"type": "string", "pattern": FREE_TEXT_PATTERN}
    if kind in ("number", "integer"):
        return {"type": kind, "minimum": -MAX_NUMBER, "maximum": MAX_NUMBER}
    if kind == "boolean":
        return {"type": kind}
    is_enum = isinstance(kind, list) and kind and all(isinstance(value, str) for value in kind)
    if is_enum and len(set(kind)) == len(kind):
        return {"type": "string", "enum": list(kind)}
    raise ValueError(f"{where}: bad argument type {kind!r} "
                     f"(expected one of {', '.join(ARG_TYPES)} or a list of distinct strings)")


def _json_schema_of(response_format: Mapping[str, Any]) -> dict[str, Any]:
    """The schema of the OpenAI shape (`json_schema.schema`) or of the flat one (`schema`)."""
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
    return dict(schema)


def _canonical_json(schema: Mapping[str, Any]) -> str:
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"response_format schema is not plain JSON: {exc}") from exc
    except RecursionError:
        raise ValueError("response_format schema is nested too deeply") from None


def _nonempty_str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def fleet_plan_format() -> dict[str, Any]:
    """The response_format of a plan over the bundled fleet traces' skills ("fleet-plan")."""
    return {"type": "json_schema", "json_schema": {"name": "fleet-plan", "schema": plan_schema(FLEET_SKILLS)}}
