"""The SDK against a real `cloudd serve` process (default model, loopback): plans valid against
the declared skills, streamed steps, cancel, deadlines, schema plans, chat, the async client."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Literal

import jsonschema
import pytest

from robot_sdk import (AsyncPlanClient, Cancelled, DeadlineExceeded, InvalidPlan, PlanClient, PlanDone, PlanStepEvent,
                       PlanText, skill)
from robot_sdk.skills import as_skills
from shared.daemon_process import DaemonProcess
from shared.plan.budget import max_plan_tokens
from shared.plan.schema import plan_schema
from shared.protocol.messages import ErrorCode
from shared.transport.client import FleetClient
from tests.robot_grants import ROBOT_GRANTS_TOML as ROBOT_GRANTS


@skill
def move_to(location: str) -> None:
    """drive the base to a named location"""


@skill
def pick(object: str, grasp: Literal["normal", "gentle"]) -> None:
    """grasp an object with the gripper; needs the object in reach"""


@skill
def place(object: str, location: str) -> None:
    """put the held object at a location"""


SKILLS = [move_to, pick, place]
TASK = "Bring the red cup to the kitchen counter."
SCENE = {"robot": "arm-1", "red cup": "dining table", "kitchen counter": "3 m north"}
# two steps, and as many tokens as two steps can take (a plan is about 70)
SHORT = {"skills": SKILLS, "max_steps": 2, "max_tokens": max_plan_tokens(as_skills(SKILLS), 2)}
LONG = {"skills": SKILLS, "max_tokens": max_plan_tokens(as_skills(SKILLS), 8)}  # eight steps may run


# its robots send safety, which [serve] grants only where named (issue 48: priority is a permission)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    cfg = tmp_path_factory.mktemp("cloudd") / "cloudd.toml"
    cfg.write_text("[engine]\nnum_blocks = 2048\n" + ROBOT_GRANTS)
    d = DaemonProcess("cloudd", ["serve", "--config", str(cfg), "--zmq-port", "0", "--http-port", "0"],
                      ready="cloudd ready:")
    yield d
    assert d.terminate() == 0, d.log()


@pytest.fixture
def client(daemon) -> Iterator[PlanClient]:
    with PlanClient(daemon.fields["zmq"], robot_id="arm-1") as c:
        yield c


def requests_served(daemon) -> int:
    with FleetClient(daemon.fields["zmq"]) as fleet:
        return fleet.stats()["totals"]["requests"]


def test_a_plan_is_valid_against_the_skills_and_a_retry_under_its_id_runs_once(daemon, client):
    before = requests_served(daemon)
    plan = client.plan(TASK, scene=SCENE, request_id="plan-1", **SHORT)
    assert plan.finish_reason == "stop" and plan.source == "cloud" and plan.degraded is False
    assert 1 <= len(plan.steps) <= 2 and {s.skill for s in plan.steps} <= {"move_to", "pick", "place"}
    schema = plan_schema([s.to_wire() for s in as_skills(SKILLS)], max_steps=2)
    jsonschema.validate(plan.data, schema)  # what the skills declared is what the daemon enforced
    assert plan.timings["e2e_s"] > 0 and plan.timings["client_e2e"] >= plan.timings["e2e_s"]
    again = client.plan(TASK, scene=SCENE, request_id="plan-1", **SHORT)
    assert again.text == plan.text and requests_served(daemon) == before + 1


def test_a_stream_yields_each_step_before_the_plan_is_complete(client):
    received, at_step = "", []
    events = list(client.stream(TASK, scene=SCENE, **SHORT))
    for event in events:
        if isinstance(event, PlanText):
            received += event.text_delta
        elif isinstance(event, PlanStepEvent):
            at_step.append(received)
    plan = events[-1].plan
    assert isinstance(events[-1], PlanDone) and received == plan.text
    assert [e.step for e in events if isinstance(e, PlanStepEvent)] == list(plan.steps)
    assert len(at_step) == len(plan.steps) and all(len(t) < len(plan.text) for t in at_step)
    assert {e.source for e in events[:-1]} == {"cloud"} == {plan.source}


def test_cancel_mid_stream_ends_the_stream_with_cancelled(client):
    events = client.stream(TASK, scene=SCENE, skills=SKILLS, max_tokens=384, request_id="cancel-stream")
    assert isinstance(next(events), PlanText)
    assert client.cancel("cancel-stream") is True
    with pytest.raises(Cancelled):
        list(events)
    assert client.cancel("no-such-request") is False


def test_cancel_from_another_thread_stops_a_waiting_plan(client):
    failure: list[BaseException] = []

    def wait_for_plan() -> None:
        try:
            client.plan(TASK, scene=SCENE, request_id="cancel-plan", **LONG)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            failure.append(e)

    waiter = threading.Thread(target=wait_for_plan)
    waiter.start()
    time.sleep(1.0)
    assert client.cancel("cancel-plan") is True
    waiter.join(30)
    assert len(failure) == 1 and isinstance(failure[0], Cancelled)


def test_deadlines_the_daemon_cannot_meet_or_that_pass_are_deadline_exceeded(client):
    client.chat([{"role": "user", "content": "hi"}], max_tokens=2)  # the server has measured its rate
    with pytest.raises(DeadlineExceeded) as info:
        client.plan(TASK, scene=SCENE, deadline_ms=1, **SHORT)
    assert info.value.code is ErrorCode.DEADLINE and info.value.message
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        client.plan(TASK, scene=SCENE, deadline_ms=800, **LONG)
    assert time.monotonic() - t0 < 3.0


def test_a_schema_plan_matches_the_schema(client):
    schema = {"type": "object", "properties": {"object": {"enum": ["red cup", "blue mug"]},
                                               "hand": {"enum": ["left", "right"]},
                                               "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
              "required": ["object", "hand", "confidence"], "additionalProperties": False}
    plan = client.plan("Which object do you pick first, and with which hand?", scene=SCENE, schema=schema,
                       max_tokens=40)
    jsonschema.validate(plan.data, schema)
    assert plan.steps == () and plan.confidence == plan.data["confidence"]


def test_a_schema_ending_in_an_enum_gets_its_closing_brace(client):
    schema = {"type": "object", "properties": {"object": {"enum": ["red cup", "blue mug"]},
                                               "hand": {"enum": ["left", "right"]}},
              "required": ["object", "hand"], "additionalProperties": False}
    plan = client.plan("Which object do you pick first, and with which hand?", scene=SCENE, schema=schema,
                       max_tokens=40)
    jsonschema.validate(plan.data, schema)


def test_too_few_tokens_for_a_skills_plan_is_refused_and_a_cut_schema_answer_is_an_invalid_plan(client):
    with pytest.raises(ValueError, match="max_tokens=6 cannot hold a complete plan"):
        client.plan(TASK, scene=SCENE, skills=SKILLS, max_tokens=6)
    schema = {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "string"}}},
              "required": ["steps"], "additionalProperties": False}
    with pytest.raises(InvalidPlan, match="max_tokens=6") as info:
        client.plan(TASK, scene=SCENE, schema=schema, max_tokens=6)
    assert info.value.text


def test_chat_returns_plain_text(client):
    reply = client.chat([{"role": "user", "content": "Name one robot skill."}], max_tokens=8)
    assert reply.text and reply.source == "cloud" and reply.usage["completion_tokens"] <= 8


def test_the_async_client_plans_and_streams_concurrently(daemon):
    async def main() -> None:
        async with AsyncPlanClient(daemon.fields["zmq"], robot_id="arm-2") as client:
            async def streamed():
                return [e async for e in client.stream(TASK, scene=SCENE, priority="safety", **SHORT)]

            plan, events = await asyncio.gather(client.plan(TASK, scene=SCENE, **SHORT), streamed())
        assert plan.steps and isinstance(events[-1], PlanDone) and events[-1].plan.steps

    asyncio.run(main())
