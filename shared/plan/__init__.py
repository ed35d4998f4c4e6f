"""The plan format, owned once and importing no torch (robots, edged and cloudd all use it).

A robot asks for a plan over its skill set; the answer is a JSON object of steps, each a skill
call. This package is the one place that knows that form:

- ``schema``: the plan's JSON schema built from a skill set (``plan_schema``), the value bounds
  and ``DEFAULT_MAX_STEPS``;
- ``budget``: the tokens a complete plan of N steps can take (``max_plan_tokens``) and the most
  steps a token budget holds (``steps_that_fit``);
- ``answer``: an answer's text parsed once under its grammar (``StructuredAnswer``: its
  ``plan``, whether it ``is_valid`` under its schema);
- ``check``: a plan checked step by step against the declared skills with a message naming
  what is wrong (``PlanCheck``, raising ``BadPlan``).

A skill set is given in the protocol's wire form to ``plan_schema`` and as objects with a
name and typed args (``skill.PlanSkill``: robot_sdk's ``Skill``) to the budget and the check.
"""

from shared.plan.answer import StructuredAnswer, plan_is_valid, spec_schema
from shared.plan.budget import max_plan_tokens, steps_that_fit
from shared.plan.check import BadPlan, CheckedPlan, PlanCheck, PlanStep
from shared.plan.schema import DEFAULT_MAX_STEPS, FREE_TEXT_PATTERN, MAX_NUMBER, MAX_STRING_CHARS, plan_schema
from shared.plan.skill import PlanArg, PlanSkill

__all__ = [
    "DEFAULT_MAX_STEPS", "FREE_TEXT_PATTERN", "MAX_NUMBER", "MAX_STRING_CHARS", "plan_schema",
    "max_plan_tokens", "steps_that_fit",
    "StructuredAnswer", "plan_is_valid", "spec_schema",
    "BadPlan", "CheckedPlan", "PlanCheck", "PlanStep",
    "PlanArg", "PlanSkill",
]
