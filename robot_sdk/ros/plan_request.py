"""A Plan goal or GetPlan request, checked and filled with the node's defaults, as the keyword
arguments of ``PlanClient.plan``/``stream``. Plain Python (no rclpy), so it is tested anywhere.

The goal's empty strings and zeros mean "the node's default"; everything else is checked here
and a bad value raises ValueError with the field's name, which the node returns as a failed
result (``ok`` false) instead of sending anything.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from robot_sdk.scene import Scene
from robot_sdk.skills import Skill
from shared.protocol.messages import Escalation, Priority

PRIORITIES = tuple(p.value for p in Priority)
ESCALATIONS = tuple(e.value for e in Escalation)


@dataclasses.dataclass(frozen=True)
class PlanDefaults:
    """The node's parameters that shape a request; ``check()`` raises ValueError naming one."""

    skills: str = "fleet"
    priority: str = "plan"
    deadline_ms: int = 0  # 0: none
    escalation: str = "auto"
    max_tokens: int = 0  # 0: each plan's own, room for max_steps complete steps (PlanClient's default)
    max_max_tokens: int = 2048  # a goal may ask for at most this many
    max_task_chars: int = 2000
    max_scene_chars: int = 16000

    def check(self, skill_sets: Mapping[str, Any]) -> None:
        if self.skills not in skill_sets:
            raise ValueError(f"default_skills: {self.skills!r} is not one of {sorted(skill_sets)}")
        if self.priority not in PRIORITIES:
            raise ValueError(f"default_priority: {self.priority!r} is not one of {PRIORITIES}")
        if self.escalation not in ESCALATIONS:
            raise ValueError(f"default_escalation: {self.escalation!r} is not one of {ESCALATIONS}")
        for name in ("deadline_ms", "max_tokens", "max_max_tokens", "max_task_chars", "max_scene_chars"):
            value = getattr(self, name)
            if value < (0 if name in ("deadline_ms", "max_tokens") else 1):
                raise ValueError(f"{_param(name)}: {value} is out of range")
        if self.max_tokens > self.max_max_tokens:
            raise ValueError(f"max_tokens: {self.max_tokens} exceeds max_max_tokens={self.max_max_tokens}")


@dataclasses.dataclass(frozen=True)
class PlanArgs:
    """Exactly one of ``skills`` and ``schema`` is set; ``skills_id`` names the set used."""

    task: str
    scene: Scene | dict[str, Any] | None
    skills: tuple[Skill, ...] | None
    schema: dict[str, Any] | None
    skills_id: str
    priority: str
    deadline_ms: int | None
    escalation: str
    max_tokens: int | None  # None: PlanClient's default, room for max_steps complete steps

    def client_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``PlanClient.plan``/``stream`` (request_id aside)."""
        return {"task": self.task, "scene": self.scene, "skills": self.skills, "schema": self.schema,
                "priority": self.priority, "deadline_ms": self.deadline_ms, "escalation": self.escalation,
                "max_tokens": self.max_tokens}


def plan_args(goal: Any, defaults: PlanDefaults, skill_sets: Mapping[str, tuple[Skill, ...]]) -> PlanArgs:
    """Read a Plan goal or GetPlan request (by field name; GetPlan has no ``max_tokens``)."""
    task = goal.task.strip()
    if not task:
        raise ValueError("task: empty")
    if len(task) > defaults.max_task_chars:
        raise ValueError(f"task: {len(task)} characters, over max_task_chars={defaults.max_task_chars}")
    scene = _scene(goal, defaults.max_scene_chars)
    schema = _json_object(goal.schema_json, "schema_json", defaults.max_scene_chars)
    skills_id = "" if schema is not None else (goal.skills or defaults.skills)
    if schema is None and skills_id not in skill_sets:
        raise ValueError(f"skills: {skills_id!r} is not one of {sorted(skill_sets)}")
    priority = goal.priority or defaults.priority
    if priority not in PRIORITIES:
        raise ValueError(f"priority: {priority!r} is not one of {PRIORITIES}")
    escalation = goal.escalation or defaults.escalation
    if escalation not in ESCALATIONS:
        raise ValueError(f"escalation: {escalation!r} is not one of {ESCALATIONS}")
    max_tokens = getattr(goal, "max_tokens", 0) or defaults.max_tokens or None
    if max_tokens is not None and max_tokens > defaults.max_max_tokens:
        raise ValueError(f"max_tokens: {max_tokens} is over max_max_tokens={defaults.max_max_tokens}")
    deadline_ms = goal.deadline_ms or defaults.deadline_ms or None
    return PlanArgs(task, scene, None if schema is not None else skill_sets[skills_id], schema, skills_id,
                    priority, deadline_ms, escalation, max_tokens)


def _scene(goal: Any, max_chars: int) -> Scene | dict[str, Any] | None:
    """A ``Scene`` when the goal names places, objects or people (its ``scene_json`` text then
    the scene's notes), else the ``scene_json`` object (or None)."""
    names = {kind: list(getattr(goal, f"scene_{kind}")) for kind in ("places", "objects", "people")}
    if not any(names.values()):
        return _json_object(goal.scene_json, "scene_json", max_chars)
    if len(goal.scene_json) > max_chars:
        raise ValueError(f"scene_json: {len(goal.scene_json)} characters, over {max_chars}")
    return Scene(**names, notes=goal.scene_json.strip())


def _json_object(text: str, field: str, max_chars: int) -> dict[str, Any] | None:
    if not text.strip():
        return None
    if len(text) > max_chars:
        raise ValueError(f"{field}: {len(text)} characters, over {max_chars}")
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{field}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{field}: expected a JSON object, got {type(value).__name__}")
    return value


def _param(name: str) -> str:
    return {"deadline_ms": "default_deadline_ms"}.get(name, name)
