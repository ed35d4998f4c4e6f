"""The node's default ``max_tokens`` as a daemon receives it: the fleetserve_ros process in
front of a scripted daemon (``tests.sdk.fake_daemon``), asked by an rclpy client in this
process. The independent client's five-step warehouse task, sent with every field left at its
default, asks for room for eight complete warehouse steps, and its five steps come back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

rclpy = pytest.importorskip("rclpy", exc_type=ImportError)  # absent, or its libraries not found
pytest.importorskip("fleetserve_interfaces", exc_type=ImportError)

from fleetserve_interfaces.srv import GetPlan  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.node import Node  # noqa: E402

from shared.plan.budget import max_plan_tokens, steps_that_fit  # noqa: E402
from robot_sdk.ros.skill_sets import load_skill_sets  # noqa: E402
from robot_sdk.scene import Scene  # noqa: E402
from shared.daemon_process import DaemonProcess  # noqa: E402
from tests.sdk.fake_daemon import FakeDaemon, result  # noqa: E402

# rosidl's lark still imports sre_parse; harmless.
pytestmark = pytest.mark.filterwarnings("ignore:module 'sre_:DeprecationWarning")
PLACES, OBJECTS = ["waypoint 17", "packing station", "charging dock 2"], ["tote 12"]
TASK = "Bring tote 12 from waypoint 17 to the packing station, then report it to the fleet manager."
STEPS = [{"skill": "goto", "args": {"waypoint": "waypoint 17"}}, {"skill": "lift", "args": {"load": "tote 12"}},
         {"skill": "goto", "args": {"waypoint": "packing station"}}, {"skill": "lower", "args": {"load": "tote 12"}},
         {"skill": "report", "args": {"message": "Tote 12 is at packing station."}}]
PLAN_TEXT = json.dumps({"steps": STEPS, "done": True, "confidence": 0.9})
WAIT_S = 60.0


@pytest.fixture(scope="module")
def daemon() -> Iterator[FakeDaemon]:
    with FakeDaemon(lambda request, attempt: [result(request, PLAN_TEXT)]) as fake:
        yield fake


@pytest.fixture(scope="module")
def get_plan(daemon) -> Iterator:
    """A call of the node's GetPlan service (the node runs with its default parameters)."""
    node = DaemonProcess("robot_sdk.ros", ["--ros-args", "-p", f"endpoint:={daemon.endpoint}", "-p", "robot_id:=amr-7"],
                         ready="fleetserve_ros ready:", timeout_s=120)
    context = rclpy.Context()
    rclpy.init(context=context)
    client_node = Node("fleetserve_defaults_client", context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(client_node)
    service = client_node.create_client(GetPlan, "/fleetserve_ros/get_plan")
    try:
        assert service.wait_for_service(timeout_sec=WAIT_S)

        def call(request: GetPlan.Request):
            future = service.call_async(request)
            executor.spin_until_future_complete(future, timeout_sec=WAIT_S)
            assert future.done(), f"no answer within {WAIT_S} s"
            return future.result().result

        yield call
    finally:
        executor.shutdown()
        client_node.destroy_node()
        rclpy.try_shutdown(context=context)
        assert node.terminate(timeout_s=30) == 0, node.log()


def test_the_default_max_tokens_holds_eight_complete_warehouse_steps(daemon, get_plan):
    answer = get_plan(GetPlan.Request(task=TASK, skills="warehouse", scene_places=PLACES, scene_objects=OBJECTS))
    assert answer.ok, answer.message
    plan = json.loads(answer.plan_json)
    assert plan["steps"] == STEPS and plan["done"] is True

    (sent,) = daemon.generates()
    warehouse = load_skill_sets()["warehouse"]
    grounded = tuple(s.grounded(Scene(places=tuple(PLACES), objects=tuple(OBJECTS))) for s in warehouse)
    assert sent.sampling.max_tokens == max_plan_tokens(grounded, 8)  # 675 here; 384 held 4 steps
    assert sent.response_format["max_steps"] == 8 and steps_that_fit(grounded, 8, 384) == 4
