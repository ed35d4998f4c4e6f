"""robot_sdk.ros: the fleetserve ROS 2 node (``python -m robot_sdk.ros``), an optional extra.

Needs ``pip install fleetserve[ros]`` and ``ros/build_interfaces.sh`` (``make ros`` does both).
Importing this package imports no rclpy; ``robot_sdk.ros.node`` does, and must come after
``robot_sdk.ros.env.ensure_local_discovery()``.
"""
