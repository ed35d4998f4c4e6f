"""The plan prompts the agreement check reads, as chat messages robot_sdk would send:

- ``demo``: the fleet demo's (``examples/fleet_demo.py``) plan requests, its scene and skills;
- ``plan-eval``: ``edged plan-eval``'s tasks (``edged/data/plan_tasks.json``), the first few.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from edged.plan_eval import load_tasks, task_messages
from robot_sdk.prompt import plan_messages, system_prompt
from robot_sdk.skills import as_skills

PROMPT_SETS = ("demo", "plan-eval")


@dataclass(frozen=True)
class NamedPrompt:
    name: str  # "demo/tote", "plan-eval/<task id>"
    messages: tuple[Mapping[str, str], ...]


def named_prompts(sets: Sequence[str], plan_eval_tasks: int) -> list[NamedPrompt]:
    """The prompts of ``sets`` (names in PROMPT_SETS; ValueError naming another), in that order;
    ``plan_eval_tasks``: how many of plan-eval's tasks, from its first."""
    prompts = []
    for name in sets:
        if name == "demo":
            prompts += demo_prompts()
        elif name == "plan-eval":
            prompts += plan_eval_prompts(plan_eval_tasks)
        else:
            raise ValueError(f"prompts: unknown set {name!r}; known: {', '.join(PROMPT_SETS)}")
    return prompts


def demo_prompts() -> list[NamedPrompt]:
    """The demo's plan requests, with the system prompt its PlanClient sends (no instructions)."""
    demo = _fleet_demo()
    skills = as_skills(demo.SKILLS)
    return [NamedPrompt(f"demo/{name}", plan_messages(task, demo.SCENE, system_prompt(skills, None, steps)))
            for name, task, steps in (demo.TOTE_TASK, demo.SAFETY_TASK)]


def _fleet_demo() -> ModuleType:
    """``examples/fleet_demo.py`` of this checkout, loaded by its path: ``examples`` is a folder of
    scripts, not an installed package, so it is on no import path outside the repository root."""
    path = Path(__file__).resolve().parents[2] / "examples" / "fleet_demo.py"
    spec = importlib.util.spec_from_file_location("fleet_demo", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plan_eval_prompts(count: int) -> list[NamedPrompt]:
    """The first ``count`` plan-eval tasks' prompts, as its local answerer builds them."""
    return [NamedPrompt(f"plan-eval/{t.id}", task_messages(t)) for t in load_tasks()[:count]]
