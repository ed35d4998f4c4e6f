"""Per-robot token buckets (shared.transport.quota) on a hand-driven clock; cloudd's quotas and
priority grants as configured."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from cloudd.server import ServeConfig
from shared.config import load_section
from shared.protocol.messages import Error, Priority, Result
from shared.transport.quota import QuotaConfig, RobotQuotas, TokenBucket
from tests.cloudd.test_server import Peer, gen, running_server


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_gives_its_burst_then_refills_at_its_rate():
    bucket = TokenBucket(rate=2.0, capacity=3.0, now=0.0)
    for _ in range(3):
        assert bucket.wait(1, now=0.0) == 0.0
        bucket.take(1)
    assert bucket.wait(1, now=0.0) == pytest.approx(0.5)
    assert bucket.wait(1, now=0.5) == 0.0
    assert bucket.wait(4, now=0.5) == math.inf  # more than it ever holds


def test_a_robot_over_its_request_rate_waits_and_others_do_not():
    clock = Clock()
    quotas = RobotQuotas(QuotaConfig(requests_per_s=1.0, burst=2), clock)
    assert [quotas.charge("a", 10) for _ in range(2)] == [0.0, 0.0]
    assert quotas.charge("a", 10) == pytest.approx(1.0)
    assert quotas.charge("b", 10) == 0.0
    clock.now = 1.0
    assert quotas.charge("a", 10) == 0.0


def test_a_refused_request_charges_neither_bucket():
    clock = Clock()
    quotas = RobotQuotas(QuotaConfig(requests_per_s=100.0, burst=5, tokens_per_min=600), clock)
    assert quotas.charge("a", 500) == 0.0
    assert quotas.charge("a", 200) == pytest.approx(10.0)  # 100 tokens left, 10 a second
    assert quotas.charge("a", 100) == 0.0  # the refused one took no request slot and no tokens
    assert quotas.charge("a", 601) == math.inf  # past a minute's worth: never


def test_buckets_are_kept_for_the_robots_seen_last():
    quotas = RobotQuotas(QuotaConfig(requests_per_s=1.0, burst=1), Clock(), max_robots=2)
    for robot in ("a", "b", "c"):
        quotas.charge(robot, 1)
    assert quotas.charge("a", 1) == 0.0  # forgotten, so a fresh bucket
    assert quotas.charge("c", 1) > 0


def test_bad_quota_config_is_refused():
    with pytest.raises(ValueError, match="quota"):
        QuotaConfig(requests_per_s=-1)


# --- cloudd's quotas and grants (issue 48, findings 5 and 6) --------------------------------------

SHIPPED = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("serve", [ServeConfig(), load_section(SHIPPED / "cloudd.toml", "serve", ServeConfig),
                                   load_section(SHIPPED / "cluster.toml", "serve", ServeConfig)],
                         ids=["defaults", "cloudd.toml", "cluster.toml"])
def test_quotas_are_on_by_default_and_in_the_shipped_configs(serve):
    front = serve.front()
    assert front.robot_quota.requests_per_s > 0 and front.robot_quota.tokens_per_min > 0
    assert front.frame_quota.requests_per_s > 0
    assert 0 < front.robot_max_in_flight < serve.max_waiting
    assert not front.priority_grants.allows("tenant-a", Priority.SAFETY)  # safety only where granted


@pytest.mark.parametrize("config", ["cloudd.toml", "cluster.toml"])
def test_the_shipped_configs_grant_safety_to_the_fleet_s_robots(config):
    """edged escalates a robot's safety plan to cloudd as that robot (its key's name)."""
    grants = load_section(SHIPPED / config, "serve", ServeConfig).priority_classes()
    assert grants.allows("amr-030", Priority.SAFETY) and grants.allows("man-209", Priority.SAFETY)


def test_max_in_flight_must_leave_room_for_other_robots():
    with pytest.raises(ValueError, match="robot_max_in_flight"):
        ServeConfig(max_waiting=64, robot_max_in_flight=64)


def test_one_robot_s_flood_does_not_get_the_next_robot_rejected_overloaded():
    """Finding 6: 4,300 frames from one client filled max_waiting; the next robot was refused."""
    with running_server(max_waiting=6, robot_max_in_flight=3) as server:
        peer = Peer(server.endpoint)
        for i in range(20):
            peer.send(gen(f"flood-{i}", robot_id="amr-1", max_tokens=64))
        peer.send(gen("victim", robot_id="amr-2", max_tokens=2))
        replies = {}
        while "victim" not in replies or len(replies) < 21:
            reply = peer.recv()
            if isinstance(reply, Result | Error):
                replies[reply.request_id] = reply
        assert isinstance(replies["victim"], Result)
        refused = [r for r in replies.values() if isinstance(r, Error)]
        assert len(refused) >= 17 and all("amr-1" in r.message and "in flight" in r.message for r in refused)
        peer.close()
