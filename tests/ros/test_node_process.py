"""The fleetserve_ros node as a real process (``python -m robot_sdk.ros``) in front of a real
``cloudd serve`` with the default model, exercised by an rclpy client in this process: the Plan
action (feedback, result, cancel, the concurrency bound), the GetPlan service, /plans,
/diagnostics and the lifecycle services.

Discovery stays on localhost with a per-run domain id (see conftest.py). Every wait is bounded,
and a watchdog kills the children and exits if a DDS call hangs, so CI never hangs here.
"""

from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

rclpy = pytest.importorskip("rclpy", exc_type=ImportError)  # absent, or its libraries not found
pytest.importorskip("fleetserve_interfaces", exc_type=ImportError)

from action_msgs.msg import GoalStatus  # noqa: E402
from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from fleetserve_interfaces.msg import PlanResult  # noqa: E402
from fleetserve_interfaces.srv import GetPlan  # noqa: E402
from lifecycle_msgs.msg import State, Transition  # noqa: E402
from lifecycle_msgs.srv import ChangeState, GetState  # noqa: E402
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy  # noqa: E402

from shared.engine.grammar.response_format import AMR_SKILLS, MANIPULATOR_SKILLS  # noqa: E402
from shared.transport.client import FleetClient  # noqa: E402
from shared.daemon_process import DaemonProcess  # noqa: E402
from tests.ros.ros_client import NODE, RosTestClient  # noqa: E402

# rosidl's lark still imports sre_parse; harmless.
pytestmark = pytest.mark.filterwarnings("ignore:module 'sre_:DeprecationWarning")

ROOT = Path(__file__).resolve().parents[2]
TASK = "Bring crate 17 from aisle 4 to the packing station."
SCENE = json.dumps({"robot": "amr-7", "at": "dock 2", "crate 17": "aisle 4, shelf B"})
PLAN_TIMEOUT_S = 240.0  # one plan on a loaded 2-core machine
TEST_TIMEOUT_S = 600.0
CHILDREN: list[DaemonProcess] = []


# --- watchdog: a hung DDS call must not hang CI -----------------------------------------------------


def _abort(what: str) -> None:
    sys.stderr.write(f"\n{what} ran past its time limit: killing the children and exiting\n")
    for child in CHILDREN:
        child.kill()
    faulthandler.dump_traceback(all_threads=True)
    os._exit(1)


@pytest.fixture(scope="module", autouse=True)
def module_watchdog() -> Iterator[None]:
    timer = threading.Timer(3 * TEST_TIMEOUT_S, _abort, args=(__name__,))
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()


@pytest.fixture(autouse=True)
def watchdog(request) -> Iterator[None]:
    timer = threading.Timer(TEST_TIMEOUT_S, _abort, args=(request.node.nodeid,))
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(TEST_TIMEOUT_S + 60, exit=True)  # if even the timer cannot run
    yield
    faulthandler.cancel_dump_traceback_later()
    timer.cancel()


# --- processes --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cloudd(tmp_path_factory) -> Iterator[DaemonProcess]:
    cfg = tmp_path_factory.mktemp("cloudd") / "cloudd.toml"
    cfg.write_text("[engine]\nnum_blocks = 2048\n")
    d = DaemonProcess("cloudd", ["serve", "--config", str(cfg), "--zmq-port", "0", "--http-port", "0"],
                      ready="cloudd ready:")
    CHILDREN.append(d)
    yield d
    assert d.terminate() == 0, d.log()


@pytest.fixture(scope="module")
def node(cloudd) -> Iterator[DaemonProcess]:
    params = {"endpoint": cloudd.fields["zmq"], "endpoint_tier": "cloud", "robot_id": "amr-7",
              "max_concurrent_goals": "1", "diagnostics_period_s": "0.5"}
    args = ["--ros-args", "--log-level", "info"] + [a for k, v in params.items() for a in ("-p", f"{k}:={v}")]
    d = DaemonProcess("robot_sdk.ros", args, ready="fleetserve_ros ready:", timeout_s=120)
    CHILDREN.append(d)
    assert d.fields["state"] == "active" and d.fields["node"] == NODE
    yield d
    assert d.terminate(timeout_s=30) == 0, d.log()  # SIGTERM: a clean shutdown


class RosClient(RosTestClient):
    """The Plan action, the GetPlan and lifecycle services, /plans and /diagnostics."""

    def __init__(self) -> None:
        super().__init__("fleetserve_test_client")
        self.get_plan = self.node.create_client(GetPlan, f"{NODE}/get_plan")
        self.change_state = self.node.create_client(ChangeState, f"{NODE}/change_state")
        self.get_state = self.node.create_client(GetState, f"{NODE}/get_state")
        self.plans: list[PlanResult] = []
        self.diagnostics: list[DiagnosticArray] = []
        latched = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self.node.create_subscription(PlanResult, "/plans", self.plans.append, latched)
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self.diagnostics.append, 10)

    def call(self, client, request, timeout_s: float = 30.0):
        return self.wait(client.call_async(request), timeout_s)


@pytest.fixture(scope="module")
def ros(node) -> Iterator[RosClient]:
    client = RosClient()
    assert client.plan.wait_for_server(timeout_sec=60)
    for service in (client.get_plan, client.change_state, client.get_state):
        assert service.wait_for_service(timeout_sec=60)
    yield client
    client.close()


def plan_of(result: PlanResult) -> dict:
    return json.loads(result.plan_json)


def names(skills) -> set[str]:
    return {s["name"] for s in skills}


# --- the Plan action ----------------------------------------------------------------------------


def test_action_streams_steps_as_feedback_then_returns_the_plan(ros):
    feedback: list = []
    goal = ros.send_goal(feedback, task=TASK, scene_json=SCENE, skills="amr")
    assert goal.accepted
    answer = ros.wait(goal.get_result_async(), PLAN_TIMEOUT_S)
    result = answer.result.result
    assert answer.status == GoalStatus.STATUS_SUCCEEDED, result.message
    assert result.ok and result.source == "cloud" and result.latency_s > 0
    plan = plan_of(result)
    assert plan["steps"] and {s["skill"] for s in plan["steps"]} <= names(AMR_SKILLS)
    assert result.request_id == plan["request_id"] and result.request_id.startswith("amr-7-")

    # Feedback: steps as they were written, each a prefix of the plan, and where it runs.
    assert feedback, "no feedback"
    for fb in feedback:
        assert fb.request_id == result.request_id and fb.source == "cloud"
        assert [json.loads(s) for s in fb.steps_json] == plan["steps"][: len(fb.steps_json)]
    assert [json.loads(s) for s in feedback[-1].steps_json] == plan["steps"]

    # /plans carries the same result.
    published = ros.spin_until(lambda: [p for p in ros.plans if p.request_id == result.request_id])
    assert published[0].plan_json == result.plan_json and published[0].ok


def test_cancel_stops_generation_and_goals_over_the_bound_are_rejected(ros, cloudd):
    running = ros.send_goal(task=TASK, scene_json=SCENE, skills="fleet", max_tokens=384)
    assert running.accepted

    # max_concurrent_goals is 1: a second goal is rejected, a service call is "busy".
    assert not ros.send_goal(task="Go to the charger.", skills="amr").accepted
    busy = ros.call(ros.get_plan, GetPlan.Request(task="Go to the charger.")).result
    assert not busy.ok and "busy" in busy.message

    cancel = ros.wait(running.cancel_goal_async())
    assert len(cancel.goals_canceling) == 1
    answer = ros.wait(running.get_result_async(), PLAN_TIMEOUT_S)
    result = answer.result.result
    assert answer.status == GoalStatus.STATUS_CANCELED
    assert not result.ok and result.message == "canceled" and result.plan_json == ""

    # The daemon stopped generating: the request ended "abort" short of max_tokens, its KV is free.
    with FleetClient(cloudd.fields["zmq"]) as daemon:
        def stopped():
            stats = daemon.stats(timeout_s=10)
            done = [r for r in stats["recent"] if r["request_id"] == result.request_id]
            return done and stats["engine"]["kv_blocks_in_requests"] == 0 and done[0]
        finished = ros.spin_until(stopped, timeout_s=30)
    assert finished["finish_reason"] == "abort" and finished["output_tokens"] < 384

    # The slot is free again: the next goal is accepted (and canceled at once).
    again = ros.send_goal(task=TASK, skills="amr")
    assert again.accepted
    ros.wait(again.cancel_goal_async())
    assert ros.wait(again.get_result_async(), PLAN_TIMEOUT_S).status in (GoalStatus.STATUS_CANCELED,
                                                                         GoalStatus.STATUS_SUCCEEDED)


# --- the GetPlan service ------------------------------------------------------------------------


def test_service_returns_a_plan_over_the_named_skill_set(ros):
    request = GetPlan.Request(task="Pick the red cup from the table and hand it to the operator.",
                              scene_json=json.dumps({"table": ["red cup", "sponge"], "operator": "at the door"}),
                              skills="manipulator", priority="interactive")
    result = ros.call(ros.get_plan, request, PLAN_TIMEOUT_S).result
    assert result.ok, result.message
    plan = plan_of(result)
    assert plan["steps"] and {s["skill"] for s in plan["steps"]} <= names(MANIPULATOR_SKILLS)
    assert result.source == "cloud"
    ros.spin_until(lambda: any(p.request_id == result.request_id for p in ros.plans))


def test_service_grounds_the_warehouse_skills_in_the_scene_names(ros):
    """The independent client's complaint: steps naming places that do not exist. With the
    scene's names in the request, every place and object of the plan is one of them."""
    places, objects = ["waypoint 17", "packing station", "charging dock 2"], ["tote 12"]
    request = GetPlan.Request(task="Bring tote 12 from waypoint 17 to the packing station.", skills="warehouse",
                              scene_places=places, scene_objects=objects, scene_json="Tote 12 is on waypoint 17.")
    result = ros.call(ros.get_plan, request, PLAN_TIMEOUT_S).result
    assert result.ok, result.message
    steps = plan_of(result)["steps"]
    assert steps
    for step in steps:
        assert step["args"].get("waypoint", places[0]) in places and step["args"].get("load", objects[0]) in objects


def test_service_answers_a_raw_json_schema(ros):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
              "additionalProperties": False}
    request = GetPlan.Request(task="Is aisle 4 blocked? Answer yes or no.", schema_json=json.dumps(schema),
                              scene_json=json.dumps({"aisle 4": "a pallet stands in the middle"}))
    result = ros.call(ros.get_plan, request, PLAN_TIMEOUT_S).result
    assert result.ok, result.message
    assert isinstance(plan_of(result)["data"]["answer"], str)


def test_service_names_a_bad_field_without_asking_the_daemon(ros):
    result = ros.call(ros.get_plan, GetPlan.Request(task=TASK, priority="urgent")).result
    assert not result.ok and "priority" in result.message and result.source == ""


# --- diagnostics and lifecycle --------------------------------------------------------------------


def test_diagnostics_report_the_endpoint_reachable_and_the_last_latency(ros, cloudd):
    failed = ros.call(ros.get_plan, GetPlan.Request(task=TASK, skills="drone")).result
    assert not failed.ok
    ros.diagnostics.clear()

    def latest():
        for msg in reversed(ros.diagnostics):
            values = {kv.key: kv.value for kv in msg.status[0].values}
            if values["reachable"] == "true" and values["last_latency_s"]:
                return msg.status[0], values
        return None

    status, values = ros.spin_until(latest, timeout_s=30)
    assert status.hardware_id == cloudd.fields["zmq"] and values["daemon_status"] == "ok"
    assert float(values["last_latency_s"]) == pytest.approx(failed.latency_s, abs=1e-3)
    assert float(values["probe_ms"]) > 0 and values["max_concurrent_goals"] == "1"
    assert status.level == bytes([1])  # WARN: reachable, but the last plan failed


def test_lifecycle_deactivate_stops_accepting_and_activate_resumes(ros):
    def state() -> int:
        return ros.call(ros.get_state, GetState.Request()).current_state.id

    def change(transition: int) -> bool:
        return ros.call(ros.change_state, ChangeState.Request(transition=Transition(id=transition))).success

    assert state() == State.PRIMARY_STATE_ACTIVE
    assert change(Transition.TRANSITION_DEACTIVATE) and state() == State.PRIMARY_STATE_INACTIVE
    assert not ros.send_goal(task=TASK).accepted
    assert "busy" in ros.call(ros.get_plan, GetPlan.Request(task=TASK)).result.message
    assert change(Transition.TRANSITION_ACTIVATE) and state() == State.PRIMARY_STATE_ACTIVE
    goal = ros.send_goal(task=TASK, skills="amr")  # accepted again; canceled at once
    assert goal.accepted
    ros.wait(goal.cancel_goal_async())
    assert ros.wait(goal.get_result_async(), PLAN_TIMEOUT_S).status in (GoalStatus.STATUS_CANCELED,
                                                                        GoalStatus.STATUS_SUCCEEDED)


def test_a_bad_parameter_fails_configure_and_the_process_exits_1():
    proc = subprocess.run([sys.executable, "-m", "robot_sdk.ros", "--ros-args", "-p", "default_skills:=drone"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "default_skills" in proc.stderr and "ready" not in proc.stdout


# --- the example ------------------------------------------------------------------------------------


def test_the_example_client_prints_steps_and_the_plan(ros):
    proc = subprocess.run([sys.executable, "examples/ros_plan_client.py", TASK, "--scene", SCENE, "--skills", "amr"],
                          cwd=ROOT, capture_output=True, text=True, timeout=PLAN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "goal accepted" in proc.stdout and "step 0 on cloud" in proc.stdout
    assert "succeeded: ok=True source=cloud" in proc.stdout
