"""The JSON schema of a skill plan, built from a skill set in the protocol's wire form.

A skill is ``{"name", "description", "args", "repeatable"}``; its ``args`` map an argument name
to "string" | "number" | "integer" | "boolean" or to a list of strings (an enum). A skill plan
is ``{"steps": [{"skill": <name>, "args": {...}}, ...], "done": <bool>, "confidence": <0..1>}``
(the form the fleet prompts ask for) of 1..``max_steps`` steps (``DEFAULT_MAX_STEPS`` unless
asked); every argument is required and no other key is allowed. No step may follow an
identical one (same skill, same arguments) unless its skill says ``"repeatable": true``
(``shared.engine.grammar.repeat_guard``). Values are bounded so a plan always ends: numbers
within +-``MAX_NUMBER``; a free-text string (a report's message) is ``FREE_TEXT_PATTERN``: a
letter, then at most ``MAX_STRING_CHARS`` - 1 letters, digits, spaces and plain punctuation
(no control characters, quotes, backslashes, braces or brackets a runaway model loops on;
starting with a letter took the default model's report messages from "20180111111221333.1.1.1"
to "The aisle 4 is blocked."). An enum (a list of strings: a scene's place names, say) allows
exactly its values.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

# a skill set's size: 2,000 skills took 195 ms of building a schema under the interpreter lock,
# stalling every thread of the daemon
MAX_SKILLS = 256
DEFAULT_MAX_STEPS = 8  # the fleet prompts' "at most 8 steps"
PLAN_KEYS = ("steps", "done", "confidence")
STEP_KEYS = ("skill", "args")
ARG_TYPES = ("string", "number", "integer", "boolean")
MAX_STRING_CHARS = 32
FREE_TEXT_PATTERN = f"^[A-Za-z][A-Za-z0-9 .,;:!?'()/_-]{{0,{MAX_STRING_CHARS - 1}}}$"
MAX_NUMBER = 10_000


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
        "required": list(PLAN_KEYS),
        "additionalProperties": False,
    }


def nonempty_str(value: Any, where: str) -> str:
    """``value`` when it is a non-empty string; ValueError naming ``where`` otherwise."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _step_schema(skill: Any, where: str) -> dict[str, Any]:
    if not isinstance(skill, Mapping):
        raise ValueError(f"{where}: expected an object with name, description and args")
    unknown = sorted(set(skill) - {"name", "description", "args", "repeatable"})
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (expected name, description, args, repeatable)")
    if not isinstance(skill.get("repeatable", False), bool):
        raise ValueError(f"{where}.repeatable: expected true or false")
    name = nonempty_str(skill.get("name"), f"{where}.name")
    args = skill.get("args", {})
    if not isinstance(args, Mapping):
        raise ValueError(f"{where}.args: expected an object mapping argument names to types")
    properties = {nonempty_str(arg, f"{where}.args key"): _arg_schema(kind, f"{where}.args.{arg}")
                  for arg, kind in args.items()}
    step: dict[str, Any] = {
        "type": "object",
        "properties": {
            "skill": {"const": name},
            "args": {"type": "object", "properties": properties, "required": list(properties),
                     "additionalProperties": False},
        },
        "required": list(STEP_KEYS),
        "additionalProperties": False,
    }
    if "description" in skill:
        step["description"] = nonempty_str(skill["description"], f"{where}.description")
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
