"""``PlanClient``: plans, streamed plans, chat and cancel over the fleet protocol.

One client holds one ``FleetClient`` link (a DEALER socket with heartbeats) to edged or cloudd
and is safe to share between threads. Reliability comes from that link: a daemon silent for
``timeout_s`` gets the request re-sent on a fresh socket with the same ``request_id`` (the
daemon runs it once and resumes a stream where it stopped), up to ``retries`` times, then the
call fails with ``Unavailable``. A ``deadline_ms`` is also kept on this side: with no answer
``DEADLINE_GRACE_S`` after it, the request is cancelled and ``DeadlineExceeded`` raised, so a
robot never waits past its deadline on a dead link.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import zmq

from robot_sdk.errors import Cancelled, DeadlineExceeded, InvalidPlan, Unavailable, error_from_reply
from robot_sdk.prompt import plan_messages, response_format, system_prompt
from robot_sdk.replies import ChatReply, Plan, PlanDone, PlanEvent, PlanStepEvent, PlanText
from robot_sdk.scene import Scene
from robot_sdk.skills import Skill, as_skills
from robot_sdk.step_scanner import StepScanner
from robot_sdk.validate import PlanChecker
from shared.plan.budget import max_plan_tokens, steps_that_fit
from shared.plan.schema import DEFAULT_MAX_STEPS
from shared.protocol.messages import (ChatMessage, Chunk, Error, ErrorCode, Escalation, Generate, Priority, Result,
                                      Sampling)
from shared.transport.client import Call, ClientConfig, FleetClient, Reply, RequestFailed
from shared.transport.curve import ClientCurve

DEADLINE_GRACE_S = 0.5  # past deadline_ms, how long to wait for the daemon's own deadline reply
SCHEMA_MAX_TOKENS = 384  # a schema= plan's default max_tokens: an arbitrary schema has no known bound
SkillLike = Skill | Callable[..., Any] | type


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A request ready to send, and how to judge its answer."""

    generate: Generate
    checker: PlanChecker | None  # None: a chat request
    until: float | None  # monotonic time after which this side gives up (deadline + grace)
    started: float


class PlanClient:
    """Plans for one robot from the daemon at ``endpoint``; use as a context manager or close().

    Args:
        robot_id: sent with every request (per-robot fairness, metrics, edged's pinned prompts).
        timeout_s: how long a silent daemon is tolerated before reconnecting and re-sending.
        retries: reconnections before a request fails with ``Unavailable``.
        instructions: extra system-prompt text (safety rules, conventions) for every plan.
        curve: the robot's CURVE keys (``ClientCurve.from_files(server_key, robot_key)``), for a
            daemon that takes only authorized keys (cloudd with CURVE on).
    """

    def __init__(self, endpoint: str, robot_id: str = "", timeout_s: float = 30.0, retries: int = 3,
                 instructions: str | None = None, context: zmq.Context | None = None,
                 curve: ClientCurve | None = None):
        self.endpoint = endpoint
        self.robot_id = robot_id
        self.instructions = instructions
        self._config = ClientConfig(timeout_s=timeout_s, heartbeat_s=min(1.0, timeout_s / 4), retries=retries,
                                    curve=curve)
        self._context = context
        self._link = FleetClient(endpoint, self._config, context)
        self._cancel_link: FleetClient | None = None  # lazily: a cancel must not take a waiter's result
        self._cancel_lock = threading.Lock()

    # --- plans ------------------------------------------------------------------------------

    def plan(self, task: str, scene: Scene | Mapping[str, Any] | str | None = None,
             skills: Sequence[SkillLike] | None = None, schema: Mapping[str, Any] | None = None,
             priority: Priority | str = "plan", deadline_ms: int | None = None,
             escalation: Escalation | str = "auto", max_tokens: int | None = None, request_id: str | None = None,
             max_steps: int = DEFAULT_MAX_STEPS, tags: Sequence[str] = ()) -> Plan:
        """A plan for ``task`` over ``skills`` (or matching the JSON ``schema``), validated.
        ``tags`` name the kind of task; edged escalates the tags its config lists. A skill
        argument of a scene kind (``Place``, ``Thing``, ``Person``) can name only what ``scene``
        (a ``Scene``, or a dict of its fields) names of that kind: the daemon's grammar allows
        nothing else and the plan is checked against it.

        ``max_tokens`` None (the default) is room for ``max_steps`` complete steps of these
        skills in this scene, whatever the model's tokenizer (``shared.plan.budget.max_plan_tokens``),
        so no default cuts a plan short; for a ``schema`` plan it is ``SCHEMA_MAX_TOKENS``. A
        given ``max_tokens`` sets the grammar's step bound: as many steps (up to ``max_steps``)
        as it surely holds (``shared.plan.budget.steps_that_fit``), so a plan always closes;
        ValueError when not even one step fits.

        Raises DeadlineExceeded, Rejected, Unavailable, InvalidPlan (the answer breaks the skills,
        or max_tokens ran out first), InvalidRequest or Cancelled; ValueError/TypeError for bad
        arguments, before anything is sent.
        """
        prepared = self._prepare_plan(task, scene, skills, schema, priority, deadline_ms, escalation, max_tokens,
                                      request_id, max_steps, tags, stream=False)
        return self._finish_plan(self._await_end(prepared), prepared)

    def stream(self, task: str, scene: Scene | Mapping[str, Any] | str | None = None,
               skills: Sequence[SkillLike] | None = None, schema: Mapping[str, Any] | None = None,
               priority: Priority | str = "plan", deadline_ms: int | None = None,
               escalation: Escalation | str = "auto", max_tokens: int | None = None, request_id: str | None = None,
               max_steps: int = DEFAULT_MAX_STEPS, tags: Sequence[str] = ()) -> Iterator[PlanEvent]:
        """``plan`` as events: ``PlanText`` per text delta, ``PlanStepEvent`` as soon as each
        step is complete (already validated), and last ``PlanDone`` with the whole plan.

        Arguments are checked now; the request is sent on the first ``next()``. Closing the
        iterator early (``break``) cancels the request. Errors are raised from the iterator.
        """
        prepared = self._prepare_plan(task, scene, skills, schema, priority, deadline_ms, escalation, max_tokens,
                                      request_id, max_steps, tags, stream=True)
        return self._stream(prepared)

    def check_plan(self, task: str, scene: Scene | Mapping[str, Any] | str | None = None,
                   skills: Sequence[SkillLike] | None = None, schema: Mapping[str, Any] | None = None,
                   priority: Priority | str = "plan", deadline_ms: int | None = None,
                   escalation: Escalation | str = "auto", max_tokens: int | None = None,
                   max_steps: int = DEFAULT_MAX_STEPS, tags: Sequence[str] = ()) -> None:
        """Raise the ValueError/TypeError that ``plan`` and ``stream`` raise for these arguments
        before sending (the same checks), and send nothing: for a caller that must refuse a bad
        request before taking it on, as the ROS node's goal callback does."""
        self._prepare_plan(task, scene, skills, schema, priority, deadline_ms, escalation, max_tokens, None,
                           max_steps, tags, stream=False)

    def system_prompt(self, skills: Sequence[SkillLike] | None = None, schema: Mapping[str, Any] | None = None,
                      max_steps: int = DEFAULT_MAX_STEPS) -> str:
        """The system prompt ``plan`` sends for these skills (or schema): list it under
        ``[[pinned]]`` in edged's config and every plan starts from its pinned KV."""
        return system_prompt(as_skills(skills) if skills is not None else None, schema, max_steps, self.instructions)

    def _stream(self, prepared: _Prepared) -> Iterator[PlanEvent]:
        call = self._link.start(prepared.generate)
        scanner = StepScanner()
        streamed = []
        ended = False
        try:
            while True:
                reply = self._next_reply(call, prepared)
                if not isinstance(reply, Chunk):
                    ended = True
                    plan = self._finish_plan(reply, prepared)
                    if list(plan.steps[: len(streamed)]) != streamed:
                        raise InvalidPlan("the streamed steps differ from the final plan", plan.request_id,
                                          text=plan.text)
                    yield PlanDone(plan)
                    return
                if reply.text:
                    yield PlanText(reply.text, reply.source.value)
                for index, element in scanner.feed(reply.text):
                    step = prepared.checker.step(_decode_element(element, prepared), index, scanner.text)
                    if step is not None:
                        streamed.append(step)
                        yield PlanStepEvent(index, step, reply.source.value)
        finally:
            if not ended:  # abandoned, invalid or timed out: stop the daemon's work
                self.cancel_nowait(prepared.generate.request_id)

    # --- chat, cancel, health -----------------------------------------------------------------

    def chat(self, messages: Sequence[Mapping[str, str]], max_tokens: int = 256, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] = (),
             priority: Priority | str = "interactive", deadline_ms: int | None = None,
             escalation: Escalation | str = "auto", response_format: Mapping[str, Any] | None = None,
             request_id: str | None = None) -> ChatReply:
        """A plain completion of chat ``messages`` (``[{"role": ..., "content": ...}, ...]``)."""
        chat_messages = _chat_messages(messages)
        sampling = Sampling(max_tokens=_positive(max_tokens, "max_tokens"), temperature=temperature, top_p=top_p,
                            seed=seed, stop=tuple(stop))
        prepared = self._prepare(chat_messages, sampling, dict(response_format) if response_format else None,
                                 priority, deadline_ms, escalation, request_id, None, stream=False)
        result = self._result_or_raise(self._await_end(prepared), prepared)
        return ChatReply(result.request_id, result.text, result.finish_reason, result.source.value, result.degraded,
                         result.escalation_reason, _timings(result, prepared), dataclasses.asdict(result.usage))

    def cancel(self, request_id: str) -> bool:
        """Stop ``request_id`` (sent by any client). True if it is now stopped by a cancel;
        False if it had already finished on its own or the daemon does not know it. A ``plan``
        or ``stream`` waiting on it raises ``Cancelled``."""
        try:
            result = self._cancel_client().cancel(request_id, timeout_s=self._config.timeout_s)
        except RequestFailed as e:
            if e.code is ErrorCode.NOT_FOUND:
                return False
            raise error_from_reply(e.error, request_id) from None
        except TimeoutError:
            raise Unavailable(f"no answer to cancel from {self.endpoint}", request_id) from None
        return result.finish_reason == "abort"

    def health(self) -> str:
        """The daemon's status ("ok", "draining", ...); Unavailable if it does not answer."""
        try:
            return self._link.health(timeout_s=self._config.timeout_s)
        except TimeoutError as e:
            raise Unavailable(str(e)) from None

    def new_request_id(self) -> str:
        """A fresh id, ``<robot_id>/<16 hex digits>``: with CURVE, cloudd takes only request ids
        that start with the robot's key name and "/"."""
        return f"{self.robot_id or 'sdk'}/{uuid.uuid4().hex[:16]}"

    def close(self) -> None:
        self._link.close()
        with self._cancel_lock:
            if self._cancel_link is not None:
                self._cancel_link.close()

    def __enter__(self) -> PlanClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals --------------------------------------------------------------------------

    def _prepare_plan(self, task, scene, skills, schema, priority, deadline_ms, escalation, max_tokens, request_id,
                      max_steps, tags, stream: bool) -> _Prepared:
        if (skills is None) == (schema is None):
            raise ValueError("give exactly one of skills=[...] and schema={...}")
        declared = as_skills(skills) if skills is not None else None
        _positive(max_steps, "max_steps")
        # the system prompt from the skills as declared (the same for every robot: pinned on edged),
        # the grammar and the checks from the skills grounded in this request's scene
        system = system_prompt(declared, schema, max_steps, self.instructions)
        if declared is not None and any(s.needs_scene for s in declared) and isinstance(scene, Mapping):
            scene = Scene.from_mapping(scene)
        grounded = tuple(s.grounded(scene if isinstance(scene, Scene) else None) for s in declared) \
            if declared is not None else None
        if max_tokens is None:  # room for max_steps complete steps: a default never cuts a plan
            max_tokens = max_plan_tokens(grounded, max_steps) if grounded is not None else SCHEMA_MAX_TOKENS
        _positive(max_tokens, "max_tokens")
        # the grammar's step bound: as many steps as max_tokens surely holds, so a plan always closes
        steps = steps_that_fit(grounded, max_steps, max_tokens) if grounded is not None else max_steps
        messages = tuple(ChatMessage(m["role"], m["content"]) for m in plan_messages(task, scene, system))
        checker = PlanChecker(grounded, steps)
        sampling = Sampling(max_tokens=max_tokens)
        return self._prepare(messages, sampling, response_format(grounded, schema, steps), priority, deadline_ms,
                             escalation, request_id, checker, stream, tags)

    def _prepare(self, messages, sampling, fmt, priority, deadline_ms, escalation, request_id, checker,
                 stream: bool, tags: Sequence[str] = ()) -> _Prepared:
        if deadline_ms is not None and (isinstance(deadline_ms, bool) or not isinstance(deadline_ms, int)):
            raise TypeError(f"deadline_ms: expected an int of milliseconds, got {deadline_ms!r}")
        if isinstance(tags, str) or not all(isinstance(t, str) and t for t in tags):
            raise TypeError(f"tags: expected a list of non-empty strings, got {tags!r}")
        rid = request_id or self.new_request_id()
        generate = Generate(rid, messages=messages, sampling=sampling, response_format=fmt,
                            priority=_enum(Priority, priority, "priority"), deadline_ms=deadline_ms,
                            robot_id=self.robot_id, escalation=_enum(Escalation, escalation, "escalation"),
                            tags=tuple(tags), stream=stream)
        now = time.monotonic()
        until = None if deadline_ms is None else now + deadline_ms / 1000 + DEADLINE_GRACE_S
        if checker is not None:
            checker.request_id = rid
        return _Prepared(generate, checker, until, now)

    def _await_end(self, prepared: _Prepared) -> Result | Error:
        """Send the request and wait for its end; past the local deadline, cancel it and raise."""
        call = self._link.start(prepared.generate)
        try:
            while isinstance(reply := self._next_reply(call, prepared), Chunk):
                pass
        except DeadlineExceeded:
            self.cancel_nowait(prepared.generate.request_id)
            raise
        return reply

    def _next_reply(self, call: Call, prepared: _Prepared) -> Reply:
        """The call's next reply; DeadlineExceeded past the local deadline (the caller cancels)."""
        timeout = None if prepared.until is None else max(0.0, prepared.until - time.monotonic())
        try:
            return next(call.events(timeout))
        except TimeoutError:
            raise DeadlineExceeded(f"no answer within deadline_ms={prepared.generate.deadline_ms} "
                                   f"(+{DEADLINE_GRACE_S} s); cancelled", prepared.generate.request_id) from None

    def _result_or_raise(self, reply: Result | Error, prepared: _Prepared) -> Result:
        """The result, or the typed error for an error reply, a cancel or a deadline stop."""
        rid = prepared.generate.request_id
        if isinstance(reply, Error):
            raise error_from_reply(reply, rid)
        if reply.finish_reason == "abort":
            raise Cancelled(reply.detail or "the request was cancelled", rid, text=reply.text)
        if reply.finish_reason == "deadline":
            raise DeadlineExceeded(reply.detail or "the deadline passed before the answer was complete", rid,
                                   ErrorCode.DEADLINE, text=reply.text)
        return reply

    def _finish_plan(self, reply: Result | Error, prepared: _Prepared) -> Plan:
        result = self._result_or_raise(reply, prepared)
        try:
            if result.plan is not None:
                checked = prepared.checker.plan(result.plan, result.text)
            else:
                checked = prepared.checker.parse(result.text)
        except InvalidPlan as e:
            if result.finish_reason == "length":
                raise InvalidPlan(f"{result.detail or 'max_tokens ran out before the plan was complete'} "
                                  f"(max_tokens={prepared.generate.sampling.max_tokens}): {e.message}",
                                  result.request_id, text=result.text) from None
            raise
        return Plan(result.request_id, checked.steps, checked.done, checked.confidence, result.source.value,
                    result.degraded, result.escalation_reason, _timings(result, prepared), result.text,
                    result.finish_reason, dataclasses.asdict(result.usage), checked.data)

    def _cancel_client(self) -> FleetClient:
        with self._cancel_lock:
            if self._cancel_link is None:
                self._cancel_link = FleetClient(self.endpoint, self._config, self._context)
            return self._cancel_link

    def cancel_nowait(self, request_id: str) -> None:
        """Send a cancel for ``request_id`` and return at once (no answer, no error)."""
        try:
            self._cancel_client().cancel(request_id, timeout_s=0.0)
        except (TimeoutError, RequestFailed, RuntimeError):
            pass


def _decode_element(element: str, prepared: _Prepared) -> Any:
    try:
        return json.loads(element)
    except ValueError:
        raise InvalidPlan(f"a streamed step is not JSON: {element[:200]!r}", prepared.generate.request_id,
                          text=element) from None


def _timings(result: Result, prepared: _Prepared) -> dict[str, float]:
    return {**result.timings, "client_e2e": time.monotonic() - prepared.started}


def _enum(cls: type, value: Any, what: str) -> Any:
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{what}: {value!r} is not one of {[m.value for m in cls]}") from None


def _positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what}: expected an integer >= 1, got {value!r}")
    return value


def _chat_messages(messages: Sequence[Mapping[str, str]]) -> tuple[ChatMessage, ...]:
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages: expected a non-empty list of {'role': ..., 'content': ...}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}]: expected {{'role': str, 'content': str}}, got {m!r}")
        out.append(ChatMessage(m["role"], m["content"]))
    return tuple(out)

