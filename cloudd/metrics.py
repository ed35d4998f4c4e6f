"""Prometheus metrics of cloudd (served at ``/metrics`` on the HTTP port).

Histograms (seconds): TTFT, TPOT, end-to-end and queue time, labelled by priority class and
robot. Robot labels are bounded: the ``max_robot_labels`` robots that finished requests most
recently have their own label series; a robot beyond them takes the series of the one seen
longest ago (whose series are dropped), so a large fleet, or a client inventing robot ids,
cannot blow up the series count nor keep the active robots out.
Gauges: running and waiting requests, KV blocks used and total. Counters: requests by
outcome, prefix-cache hit tokens, prompt tokens, preemptions, deadline misses, rejections by
reason; grammar compilations, cache hits and compile time, mask time, jump-forward tokens.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cloudd.monitor import RequestRecord
from shared.engine.engine import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250)


class ServerMetrics:
    def __init__(self, max_robot_labels: int = 64):
        self.registry = CollectorRegistry()
        self.max_robot_labels = max_robot_labels
        self._robots: OrderedDict[str, set[str]] = OrderedDict()  # robot -> its priority labels, least recent first
        labels = ("priority", "robot")
        r = self.registry

        def latency(name: str, doc: str) -> Histogram:
            return Histogram(f"fleetserve_{name}_seconds", doc, labels, buckets=_LATENCY_BUCKETS, registry=r)

        # keyed by the RequestRecord field each one observes
        self.latencies = {
            "ttft_s": latency("ttft", "Time to first token"),
            "tpot_s": latency("tpot", "Time per output token after the first"),
            "e2e_s": latency("e2e", "End-to-end request time"),
            "queue_s": latency("queue", "Time from arrival to first scheduling"),
        }
        self.requests = Counter("fleetserve_requests", "Finished requests by outcome", ("priority", "finish_reason"),
                                registry=r)
        self.output_tokens = Counter("fleetserve_output_tokens", "Generated tokens", ("priority",), registry=r)
        self.frames_dropped = Counter("fleetserve_frames_dropped", "ZeroMQ frames dropped unread: their sender was "
                                      "over [serve] frames_per_s", registry=r)
        self.rejections = Counter("fleetserve_rejections", "Requests refused at submit", ("priority", "reason"),
                                  registry=r)
        self.running = Gauge("fleetserve_running_requests", "Requests running in the engine", registry=r)
        self.waiting = Gauge("fleetserve_waiting_requests", "Requests waiting in the engine", registry=r)
        self.kv_used = Gauge("fleetserve_kv_blocks_used", "KV blocks in use (running or cached)", registry=r)
        self.kv_total = Gauge("fleetserve_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.prompt_tokens = Counter("fleetserve_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.hit_tokens = Counter("fleetserve_prefix_cache_hit_tokens", "Prompt tokens reused from the prefix cache",
                                  registry=r)
        self.preemptions = Counter("fleetserve_preemptions", "Requests preempted", registry=r)
        self.deadline_misses = Counter("fleetserve_deadline_misses", "Requests ended by their deadline", registry=r)
        self.grammar_compiles = Counter("fleetserve_grammar_compiles", "Grammars compiled (cache misses)", registry=r)
        self.grammar_cache_hits = Counter("fleetserve_grammar_cache_hits", "Grammars found compiled", registry=r)
        self.grammar_compile_seconds = Counter("fleetserve_grammar_compile_seconds", "Time compiling grammars",
                                               registry=r)
        self.mask_seconds = Counter("fleetserve_grammar_mask_seconds", "Time filling and applying token masks",
                                    registry=r)
        self.forced_tokens = Counter("fleetserve_forced_tokens", "Tokens appended by jump-forward without a decode step",
                                     registry=r)
        self.tier_hit_tokens = Counter("fleetserve_kv_tier_hit_tokens", "Prompt tokens reused, by the KV tier they "
                                       "came from (device, host, disk)", ("tier",), registry=r)
        self.tier_bytes = Counter("fleetserve_kv_tier_bytes", "Bytes copied between KV tiers", ("direction",),
                                  registry=r)
        self.tier_load_seconds = Counter("fleetserve_kv_tier_load_seconds", "Summed waits for tier loads", registry=r)
        self.tier_loads = Counter("fleetserve_kv_tier_loads", "Tier loads finished", registry=r)
        self.tier_layerwise_loads = Counter("fleetserve_kv_tier_layerwise_loads", "Tier loads run layer by layer "
                                            "under their request's forward", registry=r)
        self.tier_copy_errors = Counter("fleetserve_kv_tier_copy_errors", "Tier copies that raised (disk or device "
                                        "errors; logged)", registry=r)
        self.tier_write_seconds = Counter("fleetserve_kv_tier_write_seconds", "Summed tier write (backup, spill) time",
                                          registry=r)
        self._last: dict[object, float] = {}

    def _robot_label(self, robot_id: str, priority: str) -> str:
        """``robot_id``, now the most recently labelled robot; the one seen longest ago loses
        its series when the labels are all taken."""
        priorities = self._robots.pop(robot_id, set())
        if len(self._robots) >= self.max_robot_labels:
            gone, gone_priorities = self._robots.popitem(last=False)
            for hist in self.latencies.values():
                for p in gone_priorities:
                    with contextlib.suppress(KeyError):  # a histogram it never observed
                        hist.remove(p, gone)
        priorities.add(priority)
        self._robots[robot_id] = priorities
        return robot_id

    def on_reject(self, priority: str, reason: str) -> None:
        self.rejections.labels(priority, reason).inc()

    def on_finish(self, rec: RequestRecord) -> None:
        labels = (rec.priority, self._robot_label(rec.robot_id, rec.priority))
        for field, hist in self.latencies.items():
            if (value := getattr(rec, field)) is not None:
                hist.labels(*labels).observe(value)
        self.requests.labels(rec.priority, rec.finish_reason).inc()
        self.output_tokens.labels(rec.priority).inc(rec.output_tokens)

    def on_engine(self, s: EngineStats) -> None:
        """Follow the engine's gauges and its cumulative counts."""
        self.running.set(s.running)
        self.waiting.set(s.waiting)
        self.kv_used.set(s.blocks_used)
        self.kv_total.set(s.blocks_total)
        for counter, total in ((self.prompt_tokens, s.prompt_tokens), (self.hit_tokens, s.cache_hit_tokens),
                               (self.preemptions, s.preemptions), (self.deadline_misses, s.deadline_misses),
                               (self.grammar_compiles, s.grammar_compiles),
                               (self.grammar_cache_hits, s.grammar_cache_hits),
                               (self.grammar_compile_seconds, s.grammar_compile_s), (self.mask_seconds, s.mask_s),
                               (self.forced_tokens, s.forced_tokens)):
            counter.inc(total - self._last.get(counter, 0))
            self._last[counter] = total
        if s.tiers is not None:
            self._on_tiers(s.tiers)

    def _on_tiers(self, t) -> None:
        """Follow HiCache's cumulative counters (``EngineStats.tiers``)."""
        pairs = [(self.tier_hit_tokens.labels(k), v) for k, v in t.hit_tokens.items()]
        pairs += [(self.tier_bytes.labels(k), v) for k, v in t.bytes_moved.items()]
        pairs += [(self.tier_load_seconds, t.load_s), (self.tier_loads, t.loads),
                  (self.tier_layerwise_loads, t.loads_layerwise), (self.tier_copy_errors, t.copy_errors),
                  (self.tier_write_seconds, t.write_s)]
        for counter, total in pairs:
            counter.inc(total - self._last.get(counter, 0))
            self._last[counter] = total

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
