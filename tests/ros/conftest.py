"""ROS 2 test environment, set before anything imports rclpy.

Discovery stays on this machine (``ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST``; these wheels ignore
``ROS_LOCALHOST_ONLY``), each test run gets its own ``ROS_DOMAIN_ID`` (from the pid) so parallel
runs do not see each other, and rcl logs go to a temporary directory. Child processes (the node)
inherit all of it.
"""

from __future__ import annotations

import os
import tempfile

os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
os.environ["RMW_IMPLEMENTATION"] = "rmw_fastrtps_cpp"
os.environ["ROS_DOMAIN_ID"] = str(1 + os.getpid() % 100)  # 0..101 are the portable ids; 0 is everyone's
os.environ.setdefault("ROS_LOG_DIR", tempfile.mkdtemp(prefix="fleetserve-ros-log-"))
os.environ.pop("ROS_STATIC_PEERS", None)
