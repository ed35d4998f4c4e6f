"""Replica count from what the engines report (``EngineReplica.record_autoscaling_stats``):
Ray Serve calls the policy every control period and applies the ``[cluster]`` bounds and delays
(``min_replicas``, ``max_replicas``, ``upscale_delay_s``, ``downscale_delay_s``) to its answer."""

from __future__ import annotations

import math
from collections.abc import Mapping


class FleetAutoscaling:
    """As many replicas as keep the mean waiting queue at most ``target_queue_depth`` and the
    mean KV usage at most ``target_kv_usage``, whichever asks for more; one fewer only when both
    would stay under half their targets with it."""

    def __init__(self, target_queue_depth: float, target_kv_usage: float):
        self.target_queue_depth = target_queue_depth
        self.target_kv_usage = target_kv_usage

    def __call__(self, ctx) -> tuple[int, dict]:
        metrics = ctx.aggregated_metrics() if callable(ctx.aggregated_metrics) else (ctx.aggregated_metrics or {})
        return self.desired(ctx.current_num_replicas, metrics), {}

    def desired(self, current: int, metrics: Mapping[str, Mapping[object, float]]) -> int:
        """``metrics``: ``queue_depth`` and ``kv_usage``, each per replica."""
        queued = sum(metrics.get("queue_depth", {}).values())
        kv = sum(metrics.get("kv_usage", {}).values())
        if current == 0:
            return 1 if queued else 0
        need = max(math.ceil(queued / self.target_queue_depth), math.ceil(kv / self.target_kv_usage), 1)
        if need > current:
            return need
        fewer = current - 1
        if fewer >= 1 and queued / fewer < self.target_queue_depth / 2 and kv / fewer < self.target_kv_usage / 2:
            return fewer
        return current
