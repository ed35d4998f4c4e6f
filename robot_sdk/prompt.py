"""The messages and the ``response_format`` of a plan request.

The system prompt depends only on the skills (or schema), ``max_steps`` and the client's
``instructions``, never on the task or the robot, so every robot of a type sends the same
prefix and edged keeps it pinned in its prefix cache. The scene follows as its own user message
(it changes more slowly than tasks), then the task. This is the layout of the fleet traces
(``../shared/workloads/fleet.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from robot_sdk.scene import Scene
from robot_sdk.skills import Skill

PLAN_FORM = (
    'Answer with JSON only, no prose, in this form: {{"steps": [{{"skill": <one of the skills>, '
    '"args": {{<argument name>: <value>}}}}], "done": <true when the task is complete after these steps>, '
    '"confidence": <number from 0 to 1>}}. Use at most {max_steps} steps.'
)


def system_prompt(skills: Sequence[Skill] | None, schema: Mapping[str, Any] | None, max_steps: int,
                  instructions: str | None = None) -> str:
    """The planner's system prompt: the skills with their arguments and the answer's form."""
    lines = ["You are the task planner of a robot. You turn a task into a short plan that the robot can run."]
    if instructions:
        lines.append(instructions.strip())
    if skills is not None:
        lines.append("Available skills (name(arguments): what it does):")
        lines += [f"- {s.describe()}" for s in skills]
        lines.append("Every argument is required.")
        lines.append(PLAN_FORM.format(max_steps=max_steps))
    else:
        lines.append("Answer with JSON only, no prose, matching this JSON schema: "
                     + json.dumps(schema, separators=(",", ":"), sort_keys=False))
    return "\n".join(lines)


def plan_messages(task: str, scene: Scene | Mapping[str, Any] | str | None,
                  system: str) -> tuple[dict[str, str], ...]:
    """system, then "Scene: ..." (a Scene lists its names by kind, a dict is written as JSON),
    then "Task: ..."."""
    if not isinstance(task, str) or not task.strip():
        raise ValueError(f"task: expected a non-empty string, got {task!r}")
    messages = [{"role": "system", "content": system}]
    if scene is not None:
        if isinstance(scene, Scene):
            scene = scene.describe()
        elif isinstance(scene, Mapping):
            try:
                scene = json.dumps(scene, ensure_ascii=False, sort_keys=True)
            except (TypeError, ValueError) as e:
                raise ValueError(f"scene: not JSON-serializable ({e})") from None
        elif not isinstance(scene, str):
            raise TypeError(f"scene: expected a dict, a string or None, got {type(scene).__name__}")
        messages.append({"role": "user", "content": f"Scene: {scene}"})
    messages.append({"role": "user", "content": f"Task: {task.strip()}"})
    return tuple(messages)


def response_format(skills: Sequence[Skill] | None, schema: Mapping[str, Any] | None,
                    max_steps: int) -> dict[str, Any]:
    """``{"type": "skills", ...}`` for skills, ``{"type": "json_schema", ...}`` for a schema."""
    if skills is not None:
        return {"type": "skills", "skills": [s.to_wire() for s in skills], "max_steps": max_steps}
    if not isinstance(schema, Mapping):
        raise TypeError(f"schema: expected a JSON schema object, got {type(schema).__name__}")
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise ValueError(f"schema: not plain JSON ({e})") from None
    return {"type": "json_schema", "json_schema": {"name": "plan", "schema": dict(schema)}}
