"""When edged sends a request to cloudd instead of (or after) answering it on the robot.

Rules, in the order they are checked (the first that fires is the reason the result reports):

before running locally
- ``requested``: the request says ``escalation: cloud`` (``local`` pins it to the robot, and no
  rule below applies);
- ``context``: the prompt plus ``max_tokens`` does not fit the local KV buffer (there is then
  no local plan to fall back on);
- ``tags``: one of the request's tags is in ``escalate_tags`` (hard task kinds);
- ``local_queue``: the local queue ahead of it plus its own work cannot finish before its
  deadline, at the measured local speed;

racing (``race``): a structured request (a plan) that no rule above escalates goes to the cloud
at once, while the robot plans it too. The first usable answer wins: the robot's, when it
finishes first and no rule below escalates it (the cloud's call is then dropped), else the
cloud's (the robot's plan is then cancelled, or kept as the fallback where a rule below
escalated it). An escalated plan then costs about the cloud's time, not the robot's plus the
cloud's; the price is cloud work for the plans the robot keeps (dropped part-way). The cloud
answering first reports the reason ``race``.

after a local answer (so that answer is the fallback)
- ``invalid_plan``: a structured request's text does not parse or fails its JSON schema
  (e.g. ``max_tokens`` cut it);
- ``low_confidence``: the mean log-probability the model gave its own tokens (before the
  grammar mask) is under ``min_mean_logprob``;
- ``off_task`` (``check_task_names``): a structured answer leaves out a name the task uses. The
  names are the literals its schema allows (a plan's skill names, the scene's places, objects
  and people, enum options such as ``gentle``); the task is the text after ``Task:`` in the
  last user message (robot_sdk's layout; the whole message without one). Every literal the task
  mentions (a whole word, any case; one inside a longer mentioned literal, ``dock`` in
  ``charging dock 2``, is not a mention of its own) must be one of the answer's values, or a
  word of one of its free-text values (a report naming ``aisle 4``). "Bring tote 12 to the
  packing station" answered with ``lift tote 12`` alone escalates; so does "open the fridge"
  answered by opening the drawer. A request with token ids instead of messages is not checked.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.engine.grammar.response_format import GrammarSpec
from shared.engine.request import FinishReason
from shared.plan.answer import StructuredAnswer, spec_schema
from shared.protocol.messages import Escalation, Generate

if TYPE_CHECKING:  # NOTE: the generator loads torch; the config and plan-eval's CLI import this module
    from edged.generation import LocalJob


class EscalationReason(enum.Enum):
    REQUESTED = "requested"
    CONTEXT = "context"
    TAGS = "tags"
    LOCAL_QUEUE = "local_queue"
    INVALID_PLAN = "invalid_plan"
    LOW_CONFIDENCE = "low_confidence"
    OFF_TASK = "off_task"
    RACE = "race"  # raced against the robot's plan, the cloud's came first


@dataclass(frozen=True)
class EscalationConfig:
    """The ``[escalation]`` table of edged's config."""

    cloud_endpoint: str = ""  # cloudd's ZeroMQ endpoint; empty = no cloud, everything local
    server_public_key: str = ""  # cloudd's public key file (.key): CURVE when set
    robot_secret_key: str = ""  # this robot's key pair file (.key_secret)
    escalate_tags: tuple[str, ...] = ()
    min_mean_logprob: float = -1.5  # a local plan less confident than this escalates
    check_task_names: bool = True  # a local plan that leaves out a name the task uses escalates
    heartbeat_s: float = 0.5  # probe a silent cloud this often while escalations wait
    link_timeout_s: float = 3.0  # cloud silent this long (probes unanswered): the escalation failed
    cloud_timeout_s: float = 60.0  # no deadline: stop waiting for the cloud after this
    fallback_margin_ms: int = 100  # with a deadline: answer locally this long before it
    breaker_failures: int = 3  # failures in a row that open the circuit breaker
    breaker_cooldown_s: float = 10.0  # how long an open breaker answers locally before a trial
    race: bool = False  # a plan no rule escalates before running goes to the cloud at once too

    def __post_init__(self) -> None:
        if bool(self.server_public_key) != bool(self.robot_secret_key):
            raise ValueError("server_public_key and robot_secret_key go together")
        if min(self.heartbeat_s, self.link_timeout_s, self.cloud_timeout_s) <= 0 or self.fallback_margin_ms < 0:
            raise ValueError("heartbeat_s, link_timeout_s, cloud_timeout_s must be > 0, fallback_margin_ms >= 0")


class EscalationPolicy:
    def __init__(self, config: EscalationConfig, local_context: int):
        self.config = config
        self.local_context = local_context
        self.has_cloud = bool(config.cloud_endpoint)

    def before(self, msg: Generate, prompt_tokens: int, local_wait_s: float | None) -> EscalationReason | None:
        """The reason to escalate before running locally, or None. ``local_wait_s``: when the
        local answer would be ready (seconds from now), None when unknown. A prompt that leaves
        the robot's context no room for a token is ``CONTEXT`` whatever the request asked for
        (no local run is possible; forced local, the server refuses it): a forced-local one used
        to run and fail inside the model with ``internal``. One that fits with its output cut
        short may still be forced either way."""
        if prompt_tokens >= self.local_context:
            return EscalationReason.CONTEXT
        if msg.escalation is Escalation.LOCAL:
            return None
        if msg.escalation is Escalation.CLOUD:
            return EscalationReason.REQUESTED
        if prompt_tokens + msg.sampling.max_tokens > self.local_context:
            return EscalationReason.CONTEXT
        if not self.has_cloud:
            return None
        if set(msg.tags) & set(self.config.escalate_tags):
            return EscalationReason.TAGS
        if msg.deadline_ms is not None and local_wait_s is not None and local_wait_s > msg.deadline_ms / 1000:
            return EscalationReason.LOCAL_QUEUE
        return None

    def races(self, msg: Generate) -> bool:
        """Whether ``msg`` (no rule escalated it before running) also goes to the cloud at once:
        ``race`` on, a cloud, a structured request that may escalate (``escalation: auto``)."""
        return (self.config.race and self.has_cloud and msg.escalation is Escalation.AUTO
                and msg.response_format is not None)

    def after(self, msg: Generate, job: LocalJob, answer: StructuredAnswer | None) -> EscalationReason | None:
        """The reason to escalate a finished local answer, or None. ``answer``: ``job.text``
        parsed under the request's grammar (None without one); edged's server parses each local
        answer once, for these rules and for its result's plan."""
        if msg.escalation is not Escalation.AUTO or not self.has_cloud:
            return None
        if job.finish_reason in (FinishReason.ABORT, FinishReason.DEADLINE):
            return None  # cancelled, or no time left for the cloud either
        if answer is not None and not answer.is_valid:
            return EscalationReason.INVALID_PLAN
        mean = job.mean_logprob
        if mean is not None and mean < self.config.min_mean_logprob:
            return EscalationReason.LOW_CONFIDENCE
        if self.config.check_task_names and answer is not None and msg.messages:
            if _left_out(task_text(msg), answer):
                return EscalationReason.OFF_TASK
        return None


def task_text(msg: Generate) -> str:
    """The task a request asks for: its last user message after the last ``Task:`` (robot_sdk's
    layout puts the scene before it), else that whole message; "" without one."""
    users = [m.content for m in msg.messages if m.role == "user"]
    return users[-1].rpartition("Task:")[2] if users else ""


def unnamed(task: str, text: str, spec: GrammarSpec) -> frozenset[str]:
    """The literals of ``spec``'s schema that ``task`` mentions and the structured answer
    ``text`` leaves out (see ``off_task`` above); empty for an answer that is not JSON or a spec
    without a schema."""
    return _left_out(task, StructuredAnswer.parse(text, spec))


def _left_out(task: str, answer: StructuredAnswer) -> frozenset[str]:
    """``unnamed`` of an answer parsed already."""
    if answer.value is None or answer.spec.kind != "json_schema":
        return frozenset()
    schema = spec_schema(answer.spec)
    said = {v.casefold() for v in answer.strings()}
    free = "\n".join(said - schema.folded_literals)  # NOTE: no name spans two values
    return frozenset(name for name in mentioned(task, schema.literals)
                     if name.casefold() not in said and not _find(name, free))


def mentioned(text: str, names: frozenset[str]) -> frozenset[str]:
    """The ``names`` that ``text`` mentions as whole words (any case); an occurrence inside a
    longer name's occurrence is that name's only."""
    found = [(m.start(), m.end(), name) for name in names for m in _find(name, text)]
    return frozenset(name for a, b, name in found if not any(a2 <= a and b <= b2 and b2 - a2 > b - a
                                                             for a2, b2, _ in found))


def _find(name: str, text: str) -> list[re.Match]:
    return list(re.finditer(rf"(?<!\w){re.escape(name)}(?!\w)", text, re.IGNORECASE))
