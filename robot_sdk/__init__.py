"""robot_sdk: the Python client robots use to get plans from edged or cloudd.

Imports only ``shared.protocol``, ``shared.transport`` and ``shared.plan`` (never torch), so it runs on any
robot computer. See ``examples/pick_and_place.py`` for a complete client.
"""

from robot_sdk.aio import AsyncPlanClient
from robot_sdk.client import DEADLINE_GRACE_S, PlanClient
from robot_sdk.errors import (Cancelled, DeadlineExceeded, Forbidden, InvalidPlan, InvalidRequest, PlanError,
                              Rejected, Unavailable)
from robot_sdk.replies import ChatReply, Plan, PlanDone, PlanEvent, PlanStepEvent, PlanText
from robot_sdk.scene import Person, Place, Scene, Thing
from robot_sdk.skills import Arg, Skill, as_skills, skill
from shared.plan.check import PlanStep
from shared.protocol.messages import Escalation, Priority

__all__ = [
    "AsyncPlanClient", "PlanClient", "DEADLINE_GRACE_S",
    "Plan", "PlanStep", "PlanText", "PlanStepEvent", "PlanDone", "PlanEvent", "ChatReply",
    "Skill", "Arg", "skill", "as_skills", "Scene", "Place", "Thing", "Person", "Priority", "Escalation",
    "PlanError", "DeadlineExceeded", "Rejected", "Forbidden", "Unavailable", "InvalidPlan", "InvalidRequest",
    "Cancelled",
]
