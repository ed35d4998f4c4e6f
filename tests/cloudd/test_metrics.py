"""Prometheus metrics follow the engine's cumulative HiCache counters."""

from __future__ import annotations

import random

from prometheus_client.parser import text_string_to_metric_families

from cloudd.metrics import ServerMetrics
from cloudd.monitor import RequestRecord
from shared.engine.engine import Engine
from tests.hicache.test_generation_tiers import MODEL, returning_robots, tier_config
from tests.hicache.test_layerwise_load import by_turns


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def test_tier_counters_follow_the_engine():
    engine = Engine(MODEL, None, tier_config(num_blocks=30, layerwise_load="on"))
    metrics = ServerMetrics()
    prompts = returning_robots(random.Random(1), robots=4, turns=3)
    by_turns(engine, prompts[:8], robots=4)
    metrics.on_engine(engine.stats())
    by_turns(engine, prompts[8:], robots=4)
    metrics.on_engine(engine.stats())  # counters add only what is new since the last call
    t, got = engine.stats().tiers, samples(metrics)
    assert t.loads_layerwise > 0
    assert got["fleetserve_kv_tier_layerwise_loads_total", ()] == t.loads_layerwise
    assert got["fleetserve_kv_tier_loads_total", ()] == t.loads
    assert got["fleetserve_kv_tier_copy_errors_total", ()] == t.copy_errors == 0
    assert got["fleetserve_kv_tier_hit_tokens_total", (("tier", "host"),)] == t.hit_tokens["host"]
    assert got["fleetserve_kv_tier_bytes_total", (("direction", "host_to_device"),)] == t.bytes_moved["host_to_device"]
    engine.close()


def finished(robot_id: str, priority: str = "plan") -> RequestRecord:
    return RequestRecord(request_id=f"{robot_id}/1", robot_id=robot_id, priority=priority, finish_reason="stop",
                         prompt_tokens=3, cached_tokens=0, output_tokens=2, ttft_s=0.1, tpot_s=0.01, e2e_s=0.2,
                         queue_s=0.01, finished_at=0.0)


def test_robot_labels_follow_the_robots_seen_last():
    """Found in review: the first 64 robot ids from anyone took the label slots for good (and a
    500 KB robot_id grew /metrics to 28.5 MB)."""
    metrics = ServerMetrics(max_robot_labels=2)
    for robot in ("a", "b", "a", "c"):
        metrics.on_finish(finished(robot))
    robots = {dict(labels).get("robot") for (name, labels) in samples(metrics) if name.startswith("fleetserve_ttft")}
    assert robots == {"a", "c"}  # b was seen longest ago
