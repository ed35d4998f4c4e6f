"""Named skill sets: what a Plan goal's ``skills`` id resolves to.

Built in: ``fleet`` (every skill of the bundled fleet traces), ``amr`` and ``manipulator``, read
as data from ``shared/engine/grammar/response_format`` (plain dicts; that module imports no
torch), and ``warehouse``: a mobile robot's skills grounded in the goal's scene (its
``scene_places`` and ``scene_objects``). A JSON file adds or replaces sets::

    {"picker": [{"name": "pick", "description": "grasp an object", "args": {"object": "object"}}]}

with each entry in the daemon's skill form (``args`` maps a name to "string" | "number" |
"integer" | "boolean" or to a list of allowed strings) or a scene kind: "place", "object",
"person" (the goal's scene names of that kind, ``robot_sdk.scene``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from robot_sdk.skills import Skill
from shared.engine.grammar.response_format import AMR_SKILLS, FLEET_SKILLS, MANIPULATOR_SKILLS

WAREHOUSE_SKILLS: tuple[dict[str, Any], ...] = (
    {"name": "goto", "description": "drive to a named waypoint", "args": {"waypoint": "place"}},
    {"name": "lift", "description": "lift the shelf or tote under the robot", "args": {"load": "object"}},
    {"name": "lower", "description": "lower the carried shelf or tote", "args": {"load": "object"}},
    {"name": "report", "description": "send a status message to the fleet manager", "args": {"message": "string"}},
)
BUILTIN: dict[str, tuple[dict[str, Any], ...]] = {
    "fleet": FLEET_SKILLS, "amr": AMR_SKILLS, "manipulator": MANIPULATOR_SKILLS, "warehouse": WAREHOUSE_SKILLS,
}


def skills_of(entries: Sequence[Mapping[str, Any]], set_id: str) -> tuple[Skill, ...]:
    """Skills from wire-form dicts; ValueError naming the set and entry for a malformed one."""
    if isinstance(entries, str | bytes) or not isinstance(entries, Sequence) or not entries:
        raise ValueError(f"skill set {set_id!r}: expected a non-empty list of skills")
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, Mapping) or not isinstance(e.get("name"), str):
            raise ValueError(f"skill set {set_id!r}: entry {i} is not a {{'name', 'description', 'args'}} object")
        out.append(Skill.of(e["name"], e.get("description", ""), e.get("args") or {}, e.get("repeatable") is True))
    return tuple(out)


def load_skill_sets(path: str | Path | None = None) -> dict[str, tuple[Skill, ...]]:
    """The built-in sets plus those in the JSON file at ``path`` (which win on a shared id).
    Raises ValueError (with the file's name) for unreadable JSON or a malformed set."""
    sets = {name: skills_of(entries, name) for name, entries in BUILTIN.items()}
    if not path:
        return sets
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"skill_sets_file {str(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"skill_sets_file {str(path)!r}: expected a JSON object of id -> list of skills")
    for set_id, entries in data.items():
        sets[set_id] = skills_of(entries, set_id)
    return sets
