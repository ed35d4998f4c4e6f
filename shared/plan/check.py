"""Checks an answer against the declared skills, with a message a person can act on.

A skills plan must be the plan form (``shared.plan.schema``): ``{"steps": [{"skill": <name>,
"args": {...}}, ...], "done": <bool>, "confidence": <0..1>}`` with 1..max_steps steps, each
naming a declared skill with exactly its arguments, each of its type. Anything else raises
``BadPlan`` whose message names the offending step or field and quotes it. It accepts exactly
what the plan schema accepts less the schema's length bounds on strings and numbers (the
grammar's business; tests/sdk/test_validate.py checks the two agree).

Without skills (a ``schema=`` request, constrained by its own schema) an answer is only
required to be a JSON object; its ``steps`` are read when they have the step form.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

from shared.plan.schema import PLAN_KEYS, STEP_KEYS
from shared.plan.skill import PlanSkill


class BadPlan(ValueError):
    """An answer that is not a plan over the declared skills (the message says where and why)."""


@dataclasses.dataclass(frozen=True)
class PlanStep:
    """One step of a plan: a call of ``skill`` with ``args``."""

    skill: str
    args: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"skill": self.skill, "args": dict(self.args)}


@dataclasses.dataclass(frozen=True)
class CheckedPlan:
    """An answer that passed ``PlanCheck``: its steps, ``done``, ``confidence`` (None when a
    ``schema=`` answer has none) and the whole decoded object."""

    steps: tuple[PlanStep, ...]
    done: bool
    confidence: float | None
    data: dict[str, Any]


class PlanCheck:
    """Checks whole plans, or steps one at a time while a plan streams; stateless.

    ``skills`` None means a ``schema=`` request (see the module docstring).
    """

    def __init__(self, skills: Sequence[PlanSkill] | None, max_steps: int):
        self.skills = {s.name: s for s in skills} if skills is not None else None
        self.max_steps = max_steps

    def step(self, obj: Any, index: int) -> PlanStep | None:
        """Step ``index`` as a PlanStep; BadPlan if it breaks the skills (for a schema request,
        None when it does not have the step form)."""
        if self.skills is None:
            shaped = isinstance(obj, dict) and isinstance(obj.get("skill"), str) and isinstance(obj.get("args"), dict)
            return PlanStep(obj["skill"], dict(obj["args"])) if shaped else None
        where = f"step {index} {_quote(obj)}"
        if index >= self.max_steps:
            raise BadPlan(f"{where}: more than max_steps={self.max_steps} steps")
        if not isinstance(obj, dict) or set(obj) != set(STEP_KEYS):
            raise BadPlan(f'{where}: a step must be an object with exactly "skill" and "args"')
        skill = self.skills.get(obj["skill"]) if isinstance(obj["skill"], str) else None
        if skill is None:
            raise BadPlan(f"{where}: unknown skill {obj['skill']!r} (declared: {', '.join(self.skills)})")
        args = obj["args"]
        if not isinstance(args, dict):
            raise BadPlan(f"{where}: args must be an object")
        expected = {a.name: a for a in skill.args}
        missing = [n for n in expected if n not in args]
        extra = [n for n in args if n not in expected]
        if missing or extra:
            raise BadPlan(f"{where}: skill {skill.name!r} takes ({', '.join(expected)}); "
                          f"missing {missing}, unexpected {extra}")
        for name, arg in expected.items():
            if not arg.accepts(args[name]):
                raise BadPlan(f"{where}: argument {name!r} = {args[name]!r} is not {arg.describe()}")
        return PlanStep(skill.name, dict(args))

    def plan(self, obj: Any) -> CheckedPlan:
        """The whole answer ``obj`` (decoded JSON) checked; BadPlan if it is not a plan."""
        if not isinstance(obj, dict):
            raise BadPlan(f"the answer is not a JSON object: {_quote(obj)}")
        if self.skills is None:
            raw = obj.get("steps") if isinstance(obj.get("steps"), list) else []
            steps = [self.step(s, i) for i, s in enumerate(raw)]
            confidence = obj.get("confidence")
            return CheckedPlan(tuple(s for s in steps if s is not None), obj.get("done") is True,
                               float(confidence) if _is_number(confidence) else None, obj)
        extra = sorted(set(obj) - set(PLAN_KEYS))
        if extra:
            raise BadPlan(f"unexpected keys {extra} in the plan")
        raw = obj.get("steps")
        if not isinstance(raw, list) or not raw:
            raise BadPlan(f'"steps" must be a non-empty list, got {_quote(raw)}')
        steps = tuple(self.step(s, i) for i, s in enumerate(raw))
        if not isinstance(obj.get("done"), bool):
            raise BadPlan(f'"done" must be true or false, got {_quote(obj.get("done"))}')
        confidence = obj.get("confidence")
        if not (_is_number(confidence) and 0 <= confidence <= 1):
            raise BadPlan(f'"confidence" must be a number from 0 to 1, got {_quote(confidence)}')
        return CheckedPlan(steps, obj["done"], float(confidence), obj)

    def parse(self, text: str) -> CheckedPlan:
        """``text`` decoded as JSON and checked; BadPlan for text that is not JSON."""
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise BadPlan(f"the answer is not JSON ({e})") from None
        return self.plan(obj)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _quote(obj: Any, limit: int = 200) -> str:
    text = json.dumps(obj, ensure_ascii=False) if _jsonable(obj) else repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _jsonable(obj: Any) -> bool:
    try:
        json.dumps(obj)
    except (TypeError, ValueError):
        return False
    return True
