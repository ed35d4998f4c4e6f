"""An invalid Plan goal is rejected, not accepted and aborted (issue 48, finding 9): the node
checks a goal in the action server's goal callback, and a ROS client's goal handle says not
accepted. ROS 2 carries no reason with a rejection, so the node logs it and publishes it on
``~/goal_rejections`` (``diagnostic_msgs/DiagnosticStatus``, the goal's fields as values).

The fleetserve_ros process runs in front of a scripted daemon (``tests.sdk.fake_daemon``);
an rclpy client in this process sends the goals. Discovery stays on localhost with a per-run
domain id (see conftest.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

rclpy = pytest.importorskip("rclpy", exc_type=ImportError)  # absent, or its libraries not found
pytest.importorskip("fleetserve_interfaces", exc_type=ImportError)

from action_msgs.msg import GoalStatus  # noqa: E402
from diagnostic_msgs.msg import DiagnosticStatus  # noqa: E402
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy  # noqa: E402

from shared.daemon_process import DaemonProcess  # noqa: E402
from tests.ros.ros_client import NODE, RosTestClient  # noqa: E402
from tests.sdk.fake_daemon import FakeDaemon, result  # noqa: E402

# rosidl's lark still imports sre_parse; harmless.
pytestmark = pytest.mark.filterwarnings("ignore:module 'sre_:DeprecationWarning")
TASK = "Bring crate 17 from aisle 4 to the packing station."
PLAN_TEXT = json.dumps({"steps": [{"skill": "goto", "args": {"waypoint": "packing station", "speed": 1.0}}],
                        "done": True, "confidence": 0.9})
WAIT_S = 60.0


class GoalClient(RosTestClient):
    """The Plan action and a ``~/goal_rejections`` subscriber."""

    def __init__(self) -> None:
        super().__init__("fleetserve_rejection_client")
        self.rejections: list[DiagnosticStatus] = []
        latched = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self.node.create_subscription(DiagnosticStatus, f"{NODE}/goal_rejections", self.rejections.append, latched)

    def rejection_of(self, task: str) -> DiagnosticStatus:
        """The published rejection of the goal whose task is ``task``."""
        return self.spin_until(lambda: next((r for r in self.rejections
                                             if {kv.key: kv.value for kv in r.values}.get("task") == task), None),
                               WAIT_S)


@pytest.fixture(scope="module")
def daemon() -> Iterator[FakeDaemon]:
    with FakeDaemon(lambda request, attempt: [result(request, PLAN_TEXT)]) as fake:
        yield fake


@pytest.fixture(scope="module")
def node(daemon) -> Iterator[DaemonProcess]:
    args = ["--ros-args", "-p", f"endpoint:={daemon.endpoint}", "-p", "robot_id:=amr-7"]
    d = DaemonProcess("robot_sdk.ros", args, ready="fleetserve_ros ready:", timeout_s=120)
    yield d
    assert d.terminate(timeout_s=30) == 0, d.log()


@pytest.fixture(scope="module")
def ros(node) -> Iterator[GoalClient]:
    client = GoalClient()
    assert client.plan.wait_for_server(timeout_sec=WAIT_S)
    yield client
    client.close()


@pytest.mark.parametrize("fields, reason", [
    ({"skills": "drone"}, "skills: 'drone' is not one of ['amr', 'fleet', 'manipulator', 'warehouse']"),
    ({"skills": "warehouse"}, "argument 'waypoint' names a place, and no scene was given"),
    ({"skills": "amr", "max_tokens": 3}, "max_tokens=3 cannot hold a complete plan"),
    ({"skills": "amr", "priority": "urgent"}, "priority: 'urgent' is not one of"),
], ids=["unknown-skill-set", "no-scene", "max-tokens-too-small", "unknown-priority"])
def test_an_invalid_goal_is_rejected_and_its_reason_published(ros, node, daemon, fields, reason):
    task = f"{TASK} ({'-'.join(map(str, fields.values()))})"
    goal = ros.send_goal(task=task, **fields)
    assert not goal.accepted

    rejection = ros.rejection_of(task)
    assert reason in rejection.message and rejection.name == f"{NODE[1:]}: goal rejected"
    assert rejection.level == DiagnosticStatus.WARN
    values = {kv.key: kv.value for kv in rejection.values}
    assert values["skills"] == fields["skills"]
    assert reason in node.log()  # and in the node's log
    assert not [g for g in daemon.generates() if task in json.dumps([m.content for m in g.messages])]


def test_a_valid_goal_is_still_accepted_and_planned(ros, daemon):
    goal = ros.send_goal(task=TASK, skills="amr")
    assert goal.accepted
    answer = ros.wait(goal.get_result_async(), WAIT_S)
    assert answer.status == GoalStatus.STATUS_SUCCEEDED, answer.result.result.message
    assert json.loads(answer.result.result.plan_json)["steps"][0]["skill"] == "goto"
    assert not [r for r in ros.rejections if {kv.key: kv.value for kv in r.values}.get("task") == TASK]
