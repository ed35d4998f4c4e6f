"""An rclpy client of the fleetserve_ros node for tests: its own context, a Plan action client,
and waits that are always bounded (it is spun only inside them). Import after conftest.py has
set the ROS environment and rclpy is known to import."""

from __future__ import annotations

import time
from collections.abc import Callable

import rclpy
from fleetserve_interfaces.action import Plan
from rclpy.action import ActionClient
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node

NODE = "/fleetserve_ros"


class RosTestClient:
    """``node`` named ``name`` with ``plan``, the node's Plan action; subclasses add their own
    clients and subscriptions to ``node``."""

    def __init__(self, name: str) -> None:
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = Node(name, context=self.context)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.plan = ActionClient(self.node, Plan, f"{NODE}/plan")

    def wait(self, future, timeout_s: float = 30.0):
        self.executor.spin_until_future_complete(future, timeout_sec=timeout_s)
        assert future.done(), f"no answer within {timeout_s} s"
        return future.result()

    def spin_until(self, predicate: Callable[[], object], timeout_s: float = 30.0):
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if value := predicate():
                return value
            self.executor.spin_once(timeout_sec=0.1)
        raise AssertionError(f"not within {timeout_s} s: {predicate}")

    def send_goal(self, feedback: list | None = None, **fields):
        goal = Plan.Goal(**fields)
        callback = None if feedback is None else (lambda msg: feedback.append(msg.feedback))
        return self.wait(self.plan.send_goal_async(goal, feedback_callback=callback))

    def close(self) -> None:
        self.plan.destroy()
        self.executor.shutdown()
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)
