"""PlanClient and AsyncPlanClient against a scripted daemon: what goes on the wire, edge answers
(source, degraded), retries under one request id, typed errors, the local deadline, streams."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal

import pytest

from robot_sdk import (AsyncPlanClient, Cancelled, DeadlineExceeded, InvalidPlan, InvalidRequest, Place, PlanClient,
                       PlanDone, PlanError, PlanStep, PlanStepEvent, PlanText, Rejected, Scene, Unavailable, skill)
from robot_sdk.client import SCHEMA_MAX_TOKENS
from robot_sdk.skills import as_skills
from shared.plan.budget import max_plan_tokens
from shared.protocol.messages import Error, ErrorCode, Escalation, Priority, Source
from tests.sdk.fake_daemon import FakeDaemon, chunks, result


@skill
def goto(waypoint: str, speed: float) -> None:
    """drive to a named waypoint"""


@skill
def dock(kind: Literal["charger", "conveyor"]) -> None:
    """dock to a charging station or a conveyor"""


SKILLS = [goto, dock]
PLAN = {"steps": [{"skill": "goto", "args": {"waypoint": "w17", "speed": 0.5}},
                  {"skill": "dock", "args": {"kind": "charger"}}], "done": True, "confidence": 0.8}
PLAN_TEXT = json.dumps(PLAN)
DEFAULT_MAX_TOKENS = max_plan_tokens(as_skills(SKILLS), 8)  # room for the default eight steps


def answer(text: str = PLAN_TEXT, **fields):
    return lambda request, attempt: [result(request, text, **fields)]


def test_a_plan_request_carries_the_skills_format_and_every_option():
    with FakeDaemon(answer()) as daemon, PlanClient(daemon.endpoint, robot_id="amr-7") as client:
        plan = client.plan("Go charge.", scene={"battery": 12}, skills=SKILLS, priority="safety", deadline_ms=5000,
                           escalation=Escalation.LOCAL, max_tokens=500, request_id="r-1", max_steps=4)
    (sent,) = daemon.generates()
    assert (sent.request_id, sent.robot_id, sent.priority, sent.deadline_ms, sent.escalation, sent.stream) == \
        ("r-1", "amr-7", Priority.SAFETY, 5000, Escalation.LOCAL, False)
    assert sent.sampling.max_tokens == 500 and sent.sampling.temperature == 0.0
    assert sent.response_format == {"type": "skills", "max_steps": 4, "skills": [
        {"name": "goto", "description": "drive to a named waypoint", "args": {"waypoint": "string", "speed": "number"}},
        {"name": "dock", "description": "dock to a charging station or a conveyor",
         "args": {"kind": ["charger", "conveyor"]}}]}
    assert [m.role for m in sent.messages] == ["system", "user", "user"]
    assert sent.messages[1].content == 'Scene: {"battery": 12}' and sent.messages[2].content == "Task: Go charge."
    assert plan.request_id == "r-1" and plan.source == "cloud" and not plan.degraded
    assert plan.steps == (PlanStep("goto", {"waypoint": "w17", "speed": 0.5}), PlanStep("dock", {"kind": "charger"}))
    assert plan.done and plan.confidence == 0.8 and plan.text == PLAN_TEXT and plan.finish_reason == "stop"
    assert plan.timings["client_e2e"] > 0
    assert json.loads(plan.to_json())["steps"][1] == {"skill": "dock", "args": {"kind": "charger"}}


@skill
def drive_to(waypoint: Place) -> None:
    """drive to a named waypoint"""


def test_the_default_max_tokens_holds_max_steps_complete_steps_of_the_skills_in_the_scene():
    """No default cuts a plan: max_tokens left out is the longest complete plan of max_steps
    steps over the skills as grounded in this request's scene (a longer name, a larger budget);
    a schema plan, which has no known bound, gets SCHEMA_MAX_TOKENS."""
    near, far = Scene(places=("dock 2",)), Scene(places=("dock 2", "the far end of aisle 19"))
    with FakeDaemon(answer()) as daemon, PlanClient(daemon.endpoint) as client:
        client.plan("Go charge.", skills=SKILLS)
        client.plan("Go charge.", skills=SKILLS, max_steps=5)
        with pytest.raises(InvalidPlan):  # the fake's plan is not over drive_to: only what was sent matters
            client.plan("Go to dock 2.", scene=near, skills=[drive_to])
        with pytest.raises(InvalidPlan):
            client.plan("Go to dock 2.", scene=far, skills=[drive_to])
        client.plan("Go charge.", schema={"type": "object"})
    sent = daemon.generates()
    grounded = [as_skills([drive_to])[0].grounded(scene) for scene in (near, far)]
    assert [g.sampling.max_tokens for g in sent] == [
        DEFAULT_MAX_TOKENS, max_plan_tokens(as_skills(SKILLS), 5), max_plan_tokens(grounded[:1], 8),
        max_plan_tokens(grounded[1:], 8), SCHEMA_MAX_TOKENS]
    assert sent[2].sampling.max_tokens < sent[3].sampling.max_tokens
    assert [g.response_format.get("max_steps") for g in sent] == [8, 5, 8, 8, None]


def test_an_edge_fallback_is_visible_in_source_degraded_and_reason():
    script = answer(source=Source.EDGE, degraded=True, escalation_reason="low confidence; cloud timed out",
                    timings={"e2e_s": 0.2})
    with FakeDaemon(script) as daemon, PlanClient(daemon.endpoint) as client:
        plan = client.plan("Go charge.", skills=SKILLS)
    assert plan.source == "edge" and plan.degraded is True
    assert plan.escalation_reason == "low confidence; cloud timed out" and plan.timings["e2e_s"] == 0.2


def test_a_parsed_plan_from_the_daemon_is_validated_too():
    bad = {**PLAN, "steps": [{"skill": "fly", "args": {}}]}
    with FakeDaemon(answer(plan=bad, source=Source.EDGE)) as daemon, PlanClient(daemon.endpoint) as client:
        with pytest.raises(InvalidPlan, match="unknown skill 'fly'"):
            client.plan("Go charge.", skills=SKILLS)


def test_after_a_dead_link_the_request_is_sent_again_under_the_same_id():
    with FakeDaemon(answer(), drop_first_peer=True) as daemon, \
            PlanClient(daemon.endpoint, timeout_s=0.4, retries=3) as client:
        plan = client.plan("Go charge.", skills=SKILLS)
    sent = daemon.generates()
    assert len(sent) == 2 and {g.request_id for g in sent} == {plan.request_id}
    assert len({g.fingerprint() for g in sent}) == 1 and len(plan.steps) == 2


def test_a_dead_daemon_is_unavailable_after_the_retries():
    with FakeDaemon(answer(), mute=True) as daemon, PlanClient(daemon.endpoint, timeout_s=0.3, retries=1) as client:
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="after 1 retries"):
            client.plan("Go charge.", skills=SKILLS)
    assert 0.5 < time.monotonic() - t0 < 5
    assert len(daemon.generates()) == 2


def test_no_answer_by_the_deadline_cancels_and_raises_deadline_exceeded():
    with FakeDaemon(lambda request, attempt: None) as daemon, PlanClient(daemon.endpoint) as client:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="deadline_ms=300") as info:
            client.plan("Go charge.", skills=SKILLS, deadline_ms=300, request_id="late-1")
        assert 0.3 <= time.monotonic() - t0 < 3 and info.value.request_id == "late-1"
        for _ in range(100):
            if daemon.cancels():
                break
            time.sleep(0.02)
    assert daemon.cancels() == ["late-1"]


@pytest.mark.parametrize("code, cls", [
    (ErrorCode.DEADLINE, DeadlineExceeded), (ErrorCode.REJECTED, Rejected), (ErrorCode.UNAVAILABLE, Unavailable),
    (ErrorCode.INVALID_REQUEST, InvalidRequest), (ErrorCode.INTERNAL, PlanError),
])
def test_error_replies_become_typed_errors_with_the_server_s_message(code, cls):
    script = lambda request, attempt: [Error(code, "the server's words", request.request_id)]  # noqa: E731
    with FakeDaemon(script) as daemon, PlanClient(daemon.endpoint) as client:
        with pytest.raises(cls) as info:
            client.plan("Go charge.", skills=SKILLS, request_id="e-1")
    assert info.value.message == "the server's words" and info.value.code is code
    assert info.value.request_id == "e-1"


def test_a_quota_rejection_says_when_to_retry():
    script = lambda request, attempt: [Error(ErrorCode.REJECTED, "quota", request.request_id,  # noqa: E731
                                             retry_after_ms=2500)]
    with FakeDaemon(script) as daemon, PlanClient(daemon.endpoint) as client:
        with pytest.raises(Rejected) as info:
            client.plan("Go charge.", skills=SKILLS, request_id="q-1")
    assert info.value.retry_after_s == 2.5


@pytest.mark.parametrize("fields, cls, words", [
    ({"finish_reason": "abort"}, Cancelled, "cancelled"),
    ({"finish_reason": "deadline", "detail": "the deadline passed"}, DeadlineExceeded, "the deadline passed"),
    ({"finish_reason": "length", "detail": "max_tokens ran out"}, InvalidPlan,
     f"max_tokens ran out (max_tokens={DEFAULT_MAX_TOKENS})"),
])
def test_endings_without_a_plan_are_typed_errors_carrying_the_partial_text(fields, cls, words):
    with FakeDaemon(answer(PLAN_TEXT[:30], **fields)) as daemon, PlanClient(daemon.endpoint) as client:
        with pytest.raises(cls, match=r"" + words.replace("(", r"\(").replace(")", r"\)")) as info:
            client.plan("Go charge.", skills=SKILLS)
    assert info.value.text == PLAN_TEXT[:30]


def test_a_stream_yields_each_step_when_its_chunk_arrives_then_the_plan():
    end_0 = PLAN_TEXT.index("}}") + 2  # just past each step's closing brace
    end_1 = PLAN_TEXT.index("}}", end_0) + 2
    sizes = [5, end_0 - 5, 1, end_1 - end_0 - 1]  # chunks 2 and 4 close a step; a 5th has the rest
    script = lambda request, attempt: [*chunks(request, PLAN_TEXT, sizes),  # noqa: E731
                                       result(request, PLAN_TEXT, source=Source.EDGE)]
    with FakeDaemon(script) as daemon, PlanClient(daemon.endpoint) as client:
        events = list(client.stream("Go charge.", skills=SKILLS))
    assert daemon.generates()[0].stream is True
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["PlanText", "PlanText", "PlanStepEvent", "PlanText", "PlanText", "PlanStepEvent", "PlanText",
                     "PlanDone"]
    assert "".join(e.text_delta for e in events if isinstance(e, PlanText)) == PLAN_TEXT
    steps = [e for e in events if isinstance(e, PlanStepEvent)]
    assert [(e.index, e.step.skill) for e in steps] == [(0, "goto"), (1, "dock")]
    assert events[-1].plan.steps == tuple(e.step for e in steps) and events[-1].plan.source == "edge"


def test_a_streamed_step_that_breaks_the_skills_stops_the_stream_and_cancels():
    text = PLAN_TEXT.replace('"dock"', '"fly"')
    script = lambda request, attempt: chunks(request, text, [60, 10, 10, 10])  # noqa: E731; then silent
    with FakeDaemon(script) as daemon, PlanClient(daemon.endpoint) as client:
        events = client.stream("Go charge.", skills=SKILLS, request_id="s-bad")
        got = []
        with pytest.raises(InvalidPlan, match="step 1 .*unknown skill 'fly'"):
            for event in events:
                got.append(event)
        assert [e.step.skill for e in got if isinstance(e, PlanStepEvent)] == ["goto"]
        _wait_for(lambda: daemon.cancels() == ["s-bad"])


def test_leaving_a_stream_early_cancels_the_request():
    script = lambda request, attempt: chunks(request, PLAN_TEXT, [3])[:1]  # noqa: E731; one chunk, then silent
    with FakeDaemon(script) as daemon, PlanClient(daemon.endpoint) as client:
        for event in client.stream("Go charge.", skills=SKILLS, request_id="s-left"):
            assert isinstance(event, PlanText)
            break
        _wait_for(lambda: daemon.cancels() == ["s-left"])


def test_cancel_stops_a_plan_waiting_in_another_thread():
    with FakeDaemon(lambda request, attempt: None) as daemon, PlanClient(daemon.endpoint) as client:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.plan, "Go charge.", skills=SKILLS, request_id="c-1")
            _wait_for(lambda: daemon.generates())
            assert client.cancel("c-1") is True
            with pytest.raises(Cancelled):
                waiting.result(5)
        assert client.cancel("c-1") is False  # the fake forgets cancelled requests: not found


def test_bad_arguments_are_refused_before_anything_is_sent():
    with FakeDaemon(answer()) as daemon, PlanClient(daemon.endpoint) as client:
        with pytest.raises(ValueError, match="exactly one of skills"):
            client.plan("go", skills=SKILLS, schema={"type": "object"})
        with pytest.raises(ValueError, match="exactly one of skills"):
            client.plan("go")
        with pytest.raises(ValueError, match="priority: 'urgent' is not one of"):
            client.plan("go", skills=SKILLS, priority="urgent")
        with pytest.raises(ValueError, match="escalation"):
            client.stream("go", skills=SKILLS, escalation="sky")
        with pytest.raises(ValueError, match=r"deadline_ms must be in \[1, "):
            client.plan("go", skills=SKILLS, deadline_ms=0)
        with pytest.raises(ValueError, match="max_tokens"):
            client.plan("go", skills=SKILLS, max_tokens=0)
        with pytest.raises(ValueError, match=r"messages\[1\]"):
            client.chat([{"role": "user", "content": "hi"}, {"role": "user"}])
        with pytest.raises(ValueError, match="priority: 'urgent' is not one of"):
            client.check_plan("go", skills=SKILLS, priority="urgent")  # the same checks, nothing sent
        with pytest.raises(ValueError, match="max_tokens"):
            client.check_plan("go", skills=SKILLS, max_tokens=0)
        assert client.check_plan("go", skills=SKILLS) is None
    assert daemon.generates() == []


def test_the_async_client_plans_streams_and_cancels_a_cancelled_task():
    script = lambda request, attempt: (None if request.request_id.startswith("a-slow") else  # noqa: E731
                                       [*chunks(request, PLAN_TEXT, [50]), result(request, PLAN_TEXT)])

    async def main(daemon: FakeDaemon) -> None:
        async with AsyncPlanClient(daemon.endpoint, robot_id="amr-1") as client:
            a, b = await asyncio.gather(client.plan("Go charge.", skills=SKILLS),
                                        client.plan("Go charge.", skills=SKILLS, priority=Priority.SAFETY))
            assert a.steps == b.steps and len(a.steps) == 2
            events = [e async for e in client.stream("Go charge.", skills=SKILLS)]
            assert isinstance(events[-1], PlanDone) and sum(isinstance(e, PlanStepEvent) for e in events) == 2
            task = asyncio.create_task(client.plan("Go charge.", skills=SKILLS, request_id="a-slow"))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.3)
            assert daemon.cancels() == ["a-slow"]

            async def consume() -> None:
                async for _ in client.stream("Go charge.", skills=SKILLS, request_id="a-slow-stream"):
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.3)
            assert daemon.cancels() == ["a-slow", "a-slow-stream"]

    with FakeDaemon(script) as daemon:
        asyncio.run(main(daemon))


def _wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_stream_past_its_deadline_raises_and_cancels_once():
    script = lambda request, attempt: chunks(request, PLAN_TEXT, [3])[:1]  # noqa: E731; one chunk, then silent
    with FakeDaemon(script) as daemon, PlanClient(daemon.endpoint) as client:
        events = client.stream("Go charge.", skills=SKILLS, deadline_ms=200, request_id="s-late")
        assert isinstance(next(events), PlanText)
        with pytest.raises(DeadlineExceeded):
            next(events)
        _wait_for(lambda: daemon.cancels())
        time.sleep(0.2)
    assert daemon.cancels() == ["s-late"]
