"""The ids edged escalates under: per robot, within the protocol's bound, stable for a retry."""

from __future__ import annotations

from edged.cloud_link import escalated_id
from shared.protocol.messages import MAX_REQUEST_ID_CHARS, MAX_ROBOT_ID_CHARS


def test_escalated_ids_are_per_robot_bounded_and_stable():
    assert escalated_id("amr-1", "plan-7") == "amr-1/plan-7"
    long_robot, long_request = "r" * MAX_ROBOT_ID_CHARS, "q" * MAX_REQUEST_ID_CHARS
    cloud_id = escalated_id(long_robot, long_request)
    assert len(cloud_id) <= MAX_REQUEST_ID_CHARS and cloud_id.startswith(long_robot + "/")
    assert escalated_id(long_robot, long_request) == cloud_id
    assert escalated_id(long_robot, long_request[:-1] + "x") != cloud_id
