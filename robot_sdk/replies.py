"""What the SDK hands back: ``Plan`` (of ``shared.plan``'s ``PlanStep``\\s), the stream events, ``ChatReply``.

All are frozen and built only from replies that passed validation, so a caller never sees a
plan step that is not a call of a declared skill with correctly typed arguments.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from shared.plan.check import PlanStep

Source = Literal["edge", "cloud"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """A validated plan and how it was made.

    ``source`` says which tier answered; ``degraded`` is True when edged answered with its own
    fallback because the cloud could not (``escalation_reason`` says why it tried). ``timings``
    are seconds: the daemon's (``queue``, ``ttft``, ``e2e``, ...) plus ``client_e2e``, measured
    here. ``data`` is the whole decoded JSON object (for ``schema=`` plans, the answer itself;
    their ``steps`` are filled only when it has a ``steps`` list of ``{"skill", "args"}``).
    """

    request_id: str
    steps: tuple[PlanStep, ...]
    done: bool
    confidence: float | None
    source: Source
    degraded: bool
    escalation_reason: str | None
    timings: dict[str, float]
    text: str
    finish_reason: str
    usage: dict[str, int] = dataclasses.field(default_factory=dict)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (steps as ``{"skill", "args"}`` maps)."""
        out = dataclasses.asdict(self)
        out["steps"] = [s.to_dict() for s in self.steps]
        return out

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)


@dataclasses.dataclass(frozen=True)
class ChatReply:
    """A plain (non-plan) completion from ``chat``."""

    request_id: str
    text: str
    finish_reason: str
    source: Source
    degraded: bool
    escalation_reason: str | None
    timings: dict[str, float]
    usage: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class PlanText:
    """Newly generated text of a streamed plan, and the tier writing it."""

    text_delta: str
    source: Source


@dataclasses.dataclass(frozen=True)
class PlanStepEvent:
    """Step ``index`` of a streamed plan, validated, as soon as its JSON object closed, and the
    tier that wrote it (an ``auto`` plan's events say where edged runs it)."""

    index: int
    step: PlanStep
    source: Source


@dataclasses.dataclass(frozen=True)
class PlanDone:
    """The last event of a stream: the whole validated plan."""

    plan: Plan


PlanEvent = PlanText | PlanStepEvent | PlanDone
