"""How many tokens a complete skills plan can take at most, so that a request's ``max_tokens``
always holds the plan it asks for (a plan cut short is invalid). ``max_plan_tokens(skills,
max_steps)`` is ``PlanClient``'s (and the ROS node's) default ``max_tokens``.

The plan grammar (``shared.plan.schema``, compact JSON: ``", "`` and ``": "`` separators)
bounds every value: an enum by its longest value, free text by ``MAX_STRING_CHARS``, a number
within +-``MAX_NUMBER`` by its sign, five digits, a point and six decimals (the grammar
engine's precision for a bounded number), ``confidence`` by eight characters. Every token a
grammar allows is at least one byte (the empty ones, special tokens, never are), so a plan's
UTF-8 bytes bound its tokens under any tokenizer, whatever the model does (a small model can
spell a value one character per token). The end-of-text token counts one more. The bound is
loose for real text: the longest eight-step warehouse plan is 675 tokens at one a byte, 392 as
SmolLM2-135M's tokenizer spells it and 374 as Qwen2.5-Coder's (end-of-text included;
tests/sdk/test_plan_budget.py checks both on every bundled skill set).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from shared.plan.schema import MAX_NUMBER, MAX_STRING_CHARS
from shared.plan.skill import PlanArg, PlanSkill

NUMBER_BYTES = len(f"-{MAX_NUMBER}.000000")
CONFIDENCE_BYTES = len("0.000000")


def max_plan_tokens(skills: Sequence[PlanSkill], max_steps: int) -> int:
    """The most tokens a complete plan of at most ``max_steps`` steps over ``skills`` (grounded:
    every argument's values known, else ValueError) can take, end-of-text token included."""
    step = max(_max_step_bytes(s) for s in skills)
    frame = len('{"steps": [], "done": false, "confidence": }'.encode()) + CONFIDENCE_BYTES
    return frame + max_steps * step + (max_steps - 1) * len(", ") + 1


def steps_that_fit(skills: Sequence[PlanSkill], max_steps: int, max_tokens: int) -> int:
    """The most steps (at most ``max_steps``) whose complete plan fits ``max_tokens``; ValueError
    when not even one step does, naming the tokens one needs."""
    for steps in range(max_steps, 0, -1):
        if max_plan_tokens(skills, steps) <= max_tokens:
            return steps
    raise ValueError(f"max_tokens={max_tokens} cannot hold a complete plan: one step of these skills can take "
                     f"{max_plan_tokens(skills, 1)} tokens; raise max_tokens to at least that")


def _max_step_bytes(skill: PlanSkill) -> int:
    args = ", ".join(f"{json.dumps(a.name)}: " + "x" * _max_value_bytes(a) for a in skill.args)
    return len(f'{{"skill": {json.dumps(skill.name)}, "args": {{{args}}}}}'.encode())


def _max_value_bytes(arg: PlanArg) -> int:
    if isinstance(arg.kind, tuple):
        return max(len(json.dumps(v).encode()) for v in arg.kind)
    if arg.kind == "string":
        return MAX_STRING_CHARS + 2
    if arg.kind == "boolean":
        return len("false")
    if arg.kind in ("number", "integer"):
        return NUMBER_BYTES
    raise ValueError(f"argument {arg.name!r}: ground it in a scene before bounding its plan")
