"""What the plan format reads of a declared skill, as structural types: ``robot_sdk.skills.Skill``
and ``Arg`` are ones (so are any objects with these attributes), and the budget and the checker
(``shared.plan.budget``, ``shared.plan.check``) take them without importing robot_sdk."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class PlanArg(Protocol):
    """One argument of a skill. ``kind`` is "string" | "number" | "integer" | "boolean" or a
    tuple of the allowed strings; any other kind (a scene kind not yet grounded) has no bound."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> Any: ...

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` (decoded JSON) is of this argument's type."""

    def describe(self) -> str:
        """``name: kind``, as an error message quotes it."""


class PlanSkill(Protocol):
    """One skill a plan step may call: its ``name`` and its (all required) ``args``."""

    @property
    def name(self) -> str: ...

    @property
    def args(self) -> Sequence[PlanArg]: ...
