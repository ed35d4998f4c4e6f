"""A ROS 2 client of the fleetserve_ros node: send a Plan goal, print each step as it arrives
(action feedback), then the plan. Ctrl-C (or ``--cancel-after``) cancels the goal, which stops
generation at the daemon.

    make ros                                   # once: the ROS wheels and fleetserve_interfaces
    .venv/bin/cloudd serve                     # a daemon on tcp://127.0.0.1:5555 (or edged)
    .venv/bin/python -m robot_sdk.ros --ros-args -p endpoint:=tcp://127.0.0.1:5555 -p endpoint_tier:=cloud
    .venv/bin/python examples/ros_plan_client.py "Bring crate 17 from aisle 4 to the packing station." \\
        --scene '{"robot": "amr-7", "at": "dock 2"}' --skills amr

``--service`` uses the GetPlan service instead (one answer, no feedback). Discovery stays on
this machine: ROS_AUTOMATIC_DISCOVERY_RANGE is set to LOCALHOST (anything else is refused); use
the same ROS_DOMAIN_ID as the node.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from robot_sdk.ros.env import ensure_local_discovery


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task")
    parser.add_argument("--scene", default="", help="scene as a JSON object")
    parser.add_argument("--skills", default="", help="skill-set id (fleet, amr, manipulator, warehouse, ...)")
    for kind in ("places", "objects", "people"):
        parser.add_argument(f"--{kind}", type=lambda s: [n.strip() for n in s.split(",") if n.strip()], default=[],
                            help=f"the scene's {kind}, comma-separated: a grounded skill argument names only these")
    parser.add_argument("--schema", default="", help="a raw JSON schema instead of a skill set")
    parser.add_argument("--priority", default="", choices=["", "safety", "interactive", "plan", "background"])
    parser.add_argument("--deadline-ms", type=int, default=0)
    parser.add_argument("--escalation", default="", choices=["", "auto", "local", "cloud"])
    parser.add_argument("--node", default="/fleetserve_ros")
    parser.add_argument("--service", action="store_true", help="call GetPlan instead of the Plan action")
    parser.add_argument("--cancel-after", type=float, default=None, metavar="S", help="cancel the goal after S s")
    parser.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    args = parser.parse_args()

    ensure_local_discovery()  # before rclpy.init: rcl reads it there
    import rclpy
    from rclpy.node import Node

    rclpy.init()
    node = Node("fleetserve_plan_client")
    try:
        fields = dict(task=args.task, scene_json=args.scene, skills=args.skills, schema_json=args.schema,
                      priority=args.priority, deadline_ms=args.deadline_ms, escalation=args.escalation,
                      scene_places=args.places, scene_objects=args.objects, scene_people=args.people)
        return (call_service if args.service else run_action)(node, args, fields)
    except KeyboardInterrupt:
        return 130
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


def run_action(node, args, fields: dict) -> int:
    import rclpy
    from action_msgs.msg import GoalStatus
    from fleetserve_interfaces.action import Plan
    from rclpy.action import ActionClient

    client = ActionClient(node, Plan, f"{args.node}/plan")
    if not client.wait_for_server(timeout_sec=10):
        print(f"no action server at {args.node}/plan (is the node running, on this ROS_DOMAIN_ID?)", file=sys.stderr)
        return 1

    shown = 0

    def on_feedback(msg) -> None:  # one message per new step, and a last one saying where it ran
        nonlocal shown
        fb = msg.feedback
        for i in range(shown, len(fb.steps_json)):
            print(f"  step {i} on {fb.source or '?'}: {fb.steps_json[i]}")
        shown = max(shown, len(fb.steps_json))

    sent = client.send_goal_async(Plan.Goal(**fields), feedback_callback=on_feedback)
    rclpy.spin_until_future_complete(node, sent, timeout_sec=10)
    goal = sent.result()
    if goal is None or not goal.accepted:
        print("goal rejected (node inactive, or max_concurrent_goals plans running)", file=sys.stderr)
        return 1
    print(f"goal accepted: {args.task!r}")
    result_future = goal.get_result_async()
    started = time.monotonic()
    canceled = False
    try:
        while not result_future.done() and time.monotonic() - started < args.timeout:
            rclpy.spin_once(node, timeout_sec=0.1)
            if args.cancel_after is not None and not canceled and time.monotonic() - started > args.cancel_after:
                canceled = True
                goal.cancel_goal_async()
                print("cancel requested")
    except KeyboardInterrupt:
        goal.cancel_goal_async()
        rclpy.spin_until_future_complete(node, result_future, timeout_sec=10)
    if not result_future.done():
        print("no result in time", file=sys.stderr)
        return 1
    answer = result_future.result()
    status = {GoalStatus.STATUS_SUCCEEDED: "succeeded", GoalStatus.STATUS_CANCELED: "canceled",
              GoalStatus.STATUS_ABORTED: "aborted"}.get(answer.status, str(answer.status))
    return print_result(answer.result.result, status)


def call_service(node, args, fields: dict) -> int:
    import rclpy
    from fleetserve_interfaces.srv import GetPlan

    client = node.create_client(GetPlan, f"{args.node}/get_plan")
    if not client.wait_for_service(timeout_sec=10):
        print(f"no service at {args.node}/get_plan", file=sys.stderr)
        return 1
    future = client.call_async(GetPlan.Request(**fields))
    rclpy.spin_until_future_complete(node, future, timeout_sec=args.timeout)
    if not future.done():
        print("no answer in time", file=sys.stderr)
        return 1
    return print_result(future.result().result, "answered")


def print_result(result, status: str) -> int:
    print(f"{status}: ok={result.ok} source={result.source or '-'} latency={result.latency_s:.2f} s "
          f"request={result.request_id}")
    if result.message:
        print(f"  {result.message}")
    if result.ok:
        plan = json.loads(result.plan_json)
        for i, step in enumerate(plan["steps"]):
            print(f"  {i}. {step['skill']}({', '.join(f'{k}={v!r}' for k, v in step['args'].items())})")
        print(f"  done={plan['done']} confidence={plan['confidence']}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
