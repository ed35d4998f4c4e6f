"""``python -m robot_sdk.ros [--ros-args -p endpoint:=tcp://127.0.0.1:5555 -p max_concurrent_goals:=2 ...]``

Runs the fleetserve_ros node (see ``robot_sdk.ros.node`` for its interfaces and parameters) on
a MultiThreadedExecutor until SIGINT/SIGTERM. With ``autostart`` (the default) it configures and
activates itself, then prints one ready line on stdout:
``fleetserve_ros ready: node=/fleetserve_ros endpoint=tcp://... state=active``.
Exits 2 when the environment would let discovery leave this machine, 1 when configure fails.
"""

from __future__ import annotations

import sys

from robot_sdk.ros.env import DiscoveryNotLocal, ensure_local_discovery

SPARE_THREADS = 3  # beyond one per running plan: cancels, the health probe, lifecycle requests


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    try:
        ensure_local_discovery()
    except DiscoveryNotLocal as e:
        print(f"fleetserve_ros: {e}", file=sys.stderr)
        return 2
    import rclpy  # only now: rcl reads the discovery settings at init
    from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor

    from robot_sdk.ros.node import FleetServeNode

    rclpy.init(args=argv)
    node = FleetServeNode()
    node.max_goal_threads = node.get_parameter("max_concurrent_goals").value
    executor = MultiThreadedExecutor(num_threads=max(1, node.max_goal_threads) + SPARE_THREADS)
    executor.add_node(node)
    try:
        state = "unconfigured"
        if node.get_parameter("autostart").value:
            state = _autostart(node)
            if state is None:
                return 1
        print(f"fleetserve_ros ready: node={node.get_fully_qualified_name()} "
              f"endpoint={node.get_parameter('endpoint').value} state={state}", flush=True)
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        node.stop()
        executor.shutdown(timeout_sec=5)
        node.destroy_node()
        rclpy.try_shutdown()
    return 0


def _autostart(node) -> str | None:
    """configure then activate; the state reached, or None (logged) when one failed."""
    from rclpy.lifecycle import TransitionCallbackReturn

    if node.trigger_configure() != TransitionCallbackReturn.SUCCESS:
        print("fleetserve_ros: configure failed (see the log)", file=sys.stderr)
        return None
    if node.trigger_activate() != TransitionCallbackReturn.SUCCESS:
        print("fleetserve_ros: activate failed (see the log)", file=sys.stderr)
        return None
    return "active"


if __name__ == "__main__":
    sys.exit(main())
