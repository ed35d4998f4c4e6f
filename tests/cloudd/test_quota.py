"""Per-robot token buckets (shared.transport.quota) on a hand-driven clock."""

from __future__ import annotations

import math

import pytest

from shared.transport.quota import QuotaConfig, RobotQuotas, TokenBucket


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
