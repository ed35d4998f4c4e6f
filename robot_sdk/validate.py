"""Checks an answer against the declared skills before any caller sees it.

A skills plan must be the daemon's plan form (``shared/engine/grammar/response_format``):
``{"steps": [{"skill": <name>, "args": {...}}, ...], "done": <bool>, "confidence": <0..1>}``
with 1..max_steps steps, each naming a declared skill with exactly its arguments, each of its
type. Anything else raises ``InvalidPlan`` whose message names the offending step or field and
quotes it, and whose ``text`` is the whole answer. (The daemon's length bounds on strings and
numbers are the grammar's business, not checked here.)

A ``schema=`` answer is only required to be a JSON object: the daemon constrains it to the
schema; its ``steps`` are read when they have the step form.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from robot_sdk.errors import InvalidPlan
from robot_sdk.replies import PlanStep
from robot_sdk.skills import Skill


@dataclass(frozen=True)
class CheckedPlan:
    steps: tuple[PlanStep, ...]
    done: bool
    confidence: float | None
    data: dict[str, Any]


class PlanChecker:
    """Validates whole plans, or steps one at a time while a plan streams.

    ``skills`` None means a ``schema=`` request (see the module docstring).
    """

    def __init__(self, skills: Sequence[Skill] | None, max_steps: int, request_id: str | None = None):
        self.skills = {s.name: s for s in skills} if skills is not None else None
        self.max_steps = max_steps
        self.request_id = request_id

    def step(self, obj: Any, index: int, text: str) -> PlanStep | None:
        """Step ``index`` as a PlanStep; raises InvalidPlan if it breaks the skills (for a
        schema request, None when it does not have the step form)."""
        if self.skills is None:
            shaped = isinstance(obj, dict) and isinstance(obj.get("skill"), str) and isinstance(obj.get("args"), dict)
            return PlanStep(obj["skill"], dict(obj["args"])) if shaped else None
        where = f"step {index} {_quote(obj)}"
        if index >= self.max_steps:
            self._fail(f"{where}: more than max_steps={self.max_steps} steps", text)
        if not isinstance(obj, dict) or set(obj) != {"skill", "args"}:
            self._fail(f'{where}: a step must be an object with exactly "skill" and "args"', text)
        skill = self.skills.get(obj["skill"]) if isinstance(obj["skill"], str) else None
        if skill is None:
            self._fail(f"{where}: unknown skill {obj['skill']!r} (declared: {', '.join(self.skills)})", text)
        args = obj["args"]
        if not isinstance(args, dict):
            self._fail(f"{where}: args must be an object", text)
        expected = {a.name: a for a in skill.args}
        missing = [n for n in expected if n not in args]
        extra = [n for n in args if n not in expected]
        if missing or extra:
            self._fail(f"{where}: skill {skill.name!r} takes ({', '.join(expected)}); "
                       f"missing {missing}, unexpected {extra}", text)
        for name, arg in expected.items():
            if not arg.accepts(args[name]):
                self._fail(f"{where}: argument {name!r} = {args[name]!r} is not {arg.describe()}", text)
        return PlanStep(skill.name, dict(args))

    def plan(self, obj: Any, text: str) -> CheckedPlan:
        """The whole answer checked (``obj`` decoded from ``text``, or the daemon's parsed plan)."""
        if not isinstance(obj, dict):
            self._fail(f"the answer is not a JSON object: {_quote(obj)}", text)
        if self.skills is None:
            raw = obj.get("steps") if isinstance(obj.get("steps"), list) else []
            steps = [self.step(s, i, text) for i, s in enumerate(raw)]
            confidence = obj.get("confidence")
            return CheckedPlan(tuple(s for s in steps if s is not None), obj.get("done") is True,
                               float(confidence) if _is_number(confidence) else None, obj)
        extra = sorted(set(obj) - {"steps", "done", "confidence"})
        if extra:
            self._fail(f"unexpected keys {extra} in the plan", text)
        raw = obj.get("steps")
        if not isinstance(raw, list) or not raw:
            self._fail(f'"steps" must be a non-empty list, got {_quote(raw)}', text)
        steps = tuple(self.step(s, i, text) for i, s in enumerate(raw))
        if not isinstance(obj.get("done"), bool):
            self._fail(f'"done" must be true or false, got {_quote(obj.get("done"))}', text)
        confidence = obj.get("confidence")
        if not (_is_number(confidence) and 0 <= confidence <= 1):
            self._fail(f'"confidence" must be a number from 0 to 1, got {_quote(confidence)}', text)
        return CheckedPlan(steps, obj["done"], float(confidence), obj)

    def parse(self, text: str) -> CheckedPlan:
        """``text`` decoded as JSON and checked."""
        try:
            obj = json.loads(text)
        except ValueError as e:
            self._fail(f"the answer is not JSON ({e})", text)
        return self.plan(obj, text)

    def _fail(self, message: str, text: str) -> None:
        raise InvalidPlan(message, self.request_id, text=text)


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
