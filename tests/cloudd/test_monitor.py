"""The fleet monitor keeps per-robot summaries for the robots seen last, however many ids come."""

from __future__ import annotations

from cloudd.monitor import FleetMonitor


def test_per_robot_summaries_keep_the_robots_seen_last():
    """Found in review: per-robot stats were never pruned (300 long ids made the stats reply
    3.3 MB, past the client's 1 MiB limit: fleetctl status failed)."""
    monitor = FleetMonitor("m", "fleet", max_robots=3)
    for robot in ("a", "b", "c", "a", "d", "e"):
        monitor.on_submit(robot)
    assert list(monitor.robots) == ["a", "d", "e"]  # b and c were seen least recently
    assert monitor.robots["a"].requests == 2
    assert monitor.totals["requests"] == 6
