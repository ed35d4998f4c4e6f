"""What cloudd knows about its fleet's traffic, for `fleetctl` (the `stats` reply).

``FleetMonitor`` keeps the last ``window`` finished requests and a per-robot summary; the
snapshot it builds is plain data (msgpack-able), with this shape::

    {"model": str, "model_arch": str | None, "model_params": int | None,  # None: not described
     "policy": str, "uptime_s": float, "state": "ok" | "draining",
     "throughput": {"output_tok_s": float, "requests_per_s": float, "window_s": float},
     "engine": {"running": int, "waiting": int, "kv_blocks_used": int, "kv_blocks_total": int,
                "kv_blocks_in_requests": int, "prefix_hit_rate": float, "prompt_tokens": int,
                "cache_hit_tokens": int, "cached_tokens": int, "preemptions": int,
                "deadline_misses": int, "steps": int, "dtype": str},
     "tiers": None | {"hit_tokens": {"device", "host", "disk"}, "bytes_moved": {"device_to_host",
               "host_to_device", "host_to_disk", "disk_to_host"}, "loads", "loads_skipped", "loads_layerwise",
               "load_failures", "copy_errors", "load_mean_s", "write_mean_s", "loading", "host_pages_used",
               "host_pages_total", "disk_pages", ...},  # HiCache, when the KV tiers are on
     "grammar": {"awaiting": int, "compiles": int, "cache_hits": int, "compile_s": float,
                 "mask_s": float, "forced_tokens": int},
     "queue": {"<class>": {"waiting": int, "running": int}, ...},
     "latency": {"ttft_s": {"p50", "p99"}, "tpot_s": {...}, "e2e_s": {...}, "queue_s": {...}},
     "by_priority": {"<class>": {"requests": int, "ttft_s": {"p50", "p99"}, ...}, ...},  # recent window
     "totals": {"requests": int, "completed": int, "rejected": int, "cancelled": int,
                "deadline": int, "error": int, "output_tokens": int},  # error: failed in the engine
     "robots": [{"robot_id", "requests", "live", "output_tokens", "ttft_p50_s", "ttft_p99_s",
                 "last_seen_s"}, ...],            # slowest (p99 TTFT) first
     "running": [{"request_id", "robot_id", "priority", "state", "prompt_tokens",
                  "output_tokens", "age_s"}, ...],  # every live request (state running or
                                                    # waiting), oldest first
     "recent": [{"request_id", "robot_id", "priority", "finish_reason", "output_tokens",
                 "ttft_s", "tpot_s", "e2e_s", "queue_s"}, ...]}  # the newest 50 finished

Latencies, ``by_priority`` and ``requests_per_s`` are over the recent window (the last
``window`` finished requests); ``totals`` and the robots' counts are since start and count
admitted requests (rejections are counted apart). Percentiles are nearest-rank, as the bench's.
``age_s`` is on the engine's clock, the rest on the monitor's.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from cloudd.bench_report import percentiles
from shared.engine.engine import EngineStats
from shared.engine.request import Request, RequestStatus
from shared.model.summary import ModelSummary, model_stats
from shared.protocol.messages import Priority


@dataclass(frozen=True)
class RequestRecord:
    """One finished request, as the monitor and the metrics see it."""

    request_id: str
    robot_id: str
    priority: str
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    queue_s: float | None
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float
    finished_at: float  # on the monitor's clock

    @classmethod
    def of(cls, req: Request, finished_at: float) -> RequestRecord:
        """Timings from the engine's own timestamps (all on the engine's clock)."""
        t0 = req.arrival_time
        end = req.finish_time if req.finish_time is not None else t0
        first = req.first_token_time
        n = req.num_output_tokens
        return cls(
            request_id=req.request_id,
            robot_id=req.robot_id,
            priority=req.priority.value,
            finish_reason=req.finish_reason.value if req.finish_reason else "abort",
            prompt_tokens=req.num_prompt_tokens,
            cached_tokens=req.num_cached_tokens,
            output_tokens=n,
            queue_s=None if req.scheduled_time is None else req.scheduled_time - t0,
            ttft_s=None if first is None else first - t0,
            tpot_s=(end - first) / (n - 1) if first is not None and n > 1 else None,
            e2e_s=end - t0,
            finished_at=finished_at,
        )

    def timings(self) -> dict[str, float]:
        """The ``timings`` of a result: seconds, only those that happened."""
        names = ("queue_s", "ttft_s", "tpot_s", "e2e_s")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


def latency_percentiles(values: Iterable[float | None]) -> dict[str, float | None]:
    """p50 / p99 of the values that exist (the bench's nearest-rank rule); None without data."""
    xs = [v for v in values if v is not None]
    if not xs:
        return {"p50": None, "p99": None}
    p = percentiles(xs)
    return {"p50": p["p50"], "p99": p["p99"]}


@dataclass
class _RobotSummary:
    requests: int = 0
    output_tokens: int = 0
    last_seen: float = 0.0


class FleetMonitor:
    def __init__(self, model: str, policy: str, window: int = 1000, throughput_window_s: float = 10.0,
                 clock=time.monotonic, max_robots: int = 1024, model_summary: ModelSummary | None = None):
        """Per-robot summaries are kept for the ``max_robots`` robots seen last (least recently
        seen dropped first), so the stats reply stays small whoever sends what robot ids.
        ``model_summary``: the model's architecture and parameter count for the snapshot (None
        where unknown)."""
        self.model = model
        self.model_summary = model_summary
        self.max_robots = max_robots
        self.policy = policy
        self.clock = clock
        self.started = clock()
        self.throughput_window_s = throughput_window_s
        self.recent: deque[RequestRecord] = deque(maxlen=window)
        self.robots: dict[str, _RobotSummary] = {}  # least recently seen first
        self.totals: Counter[str] = Counter()
        self._token_events: deque[tuple[float, int]] = deque()  # (when, output tokens) for throughput

    def on_submit(self, robot_id: str) -> None:
        self.totals["requests"] += 1
        self._seen(robot_id).requests += 1

    def on_reject(self) -> None:
        self.totals["rejected"] += 1

    def on_tokens(self, n: int) -> None:
        if n:
            self._token_events.append((self.clock(), n))

    def on_finish(self, record: RequestRecord) -> None:
        self.recent.append(record)
        reason = record.finish_reason
        self.totals["completed" if reason in ("stop", "length") else "cancelled" if reason == "abort" else reason] += 1
        self.totals["output_tokens"] += record.output_tokens
        self._seen(record.robot_id).output_tokens += record.output_tokens

    def _seen(self, robot_id: str) -> _RobotSummary:
        """The robot's summary, now its most recently seen (one is dropped past max_robots)."""
        summary = self.robots.pop(robot_id, None) or _RobotSummary()
        summary.last_seen = self.clock()
        self.robots[robot_id] = summary
        if len(self.robots) > self.max_robots:
            del self.robots[next(iter(self.robots))]
        return summary

    def snapshot(self, engine: EngineStats, live: Iterable[Request], draining: bool, engine_now: float) -> dict:
        """``live``: the engine's unfinished requests; ``engine_now``: the engine clock's time."""
        now = self.clock()
        while self._token_events and now - self._token_events[0][0] > self.throughput_window_s:
            self._token_events.popleft()
        span = min(self.throughput_window_s, max(now - self.started, 1e-9))
        recent_finishes = sum(1 for r in self.recent if now - r.finished_at <= self.throughput_window_s)
        live = list(live)
        return {
            **model_stats(self.model, self.model_summary),
            "policy": self.policy,
            "uptime_s": now - self.started,
            "state": "draining" if draining else "ok",
            "throughput": {
                "output_tok_s": sum(n for _, n in self._token_events) / span,
                "requests_per_s": recent_finishes / span,
                "window_s": self.throughput_window_s,
            },
            "engine": {
                "running": engine.running,
                "waiting": engine.waiting,
                "kv_blocks_used": engine.blocks_used,
                "kv_blocks_total": engine.blocks_total,
                "kv_blocks_in_requests": len({b for r in live for b in r.block_table}),
                "prefix_hit_rate": engine.prefix_hit_rate,
                "prompt_tokens": engine.prompt_tokens,
                "cache_hit_tokens": engine.cache_hit_tokens,
                "cached_tokens": engine.cached_tokens,
                "preemptions": engine.preemptions,
                "deadline_misses": engine.deadline_misses,
                "steps": engine.steps,
                "dtype": engine.dtype,
            },
            "tiers": None if engine.tiers is None else {**engine.tiers.as_dict(), "loading": engine.tier_loading},
            "grammar": {
                "awaiting": engine.awaiting_grammar,
                "compiles": engine.grammar_compiles,
                "cache_hits": engine.grammar_cache_hits,
                "compile_s": engine.grammar_compile_s,
                "mask_s": engine.mask_s,
                "forced_tokens": engine.forced_tokens,
            },
            "queue": self._queue(live),
            "latency": self._latency(self.recent),
            "by_priority": {
                p.value: {"requests": len(rs), **self._latency(rs)}
                for p in Priority
                if (rs := [r for r in self.recent if r.priority == p.value])
            },
            "totals": {k: self.totals[k] for k in ("requests", "completed", "rejected", "cancelled", "deadline",
                                                    "error", "output_tokens")},
            "robots": self._robots(live, now),
            "running": [self._live_row(r, engine_now) for r in sorted(live, key=lambda r: r.arrival_time)],
            "recent": [
                {k: v for k, v in asdict(r).items() if k not in ("prompt_tokens", "cached_tokens", "finished_at")}
                for r in reversed(self.recent)
            ][:50],
        }

    @staticmethod
    def _queue(live: list[Request]) -> dict:
        queue = {p.value: {"waiting": 0, "running": 0} for p in Priority}
        for r in live:
            queue[r.priority.value]["running" if r.status == RequestStatus.RUNNING else "waiting"] += 1
        return queue

    @staticmethod
    def _latency(records: Iterable[RequestRecord]) -> dict:
        records = list(records)
        return {name: latency_percentiles(getattr(r, name) for r in records) for name in ("ttft_s", "tpot_s", "e2e_s", "queue_s")}

    def _robots(self, live: list[Request], now: float) -> list[dict]:
        live_count = Counter(r.robot_id for r in live)
        ttfts: dict[str, list[float]] = {}
        for rec in self.recent:
            if rec.ttft_s is not None:
                ttfts.setdefault(rec.robot_id, []).append(rec.ttft_s)
        rows = []
        for robot, s in self.robots.items():
            p = latency_percentiles(ttfts.get(robot, []))
            rows.append({
                "robot_id": robot, "requests": s.requests, "live": live_count[robot],
                "output_tokens": s.output_tokens, "ttft_p50_s": p["p50"], "ttft_p99_s": p["p99"],
                "last_seen_s": now - s.last_seen,
            })
        rows.sort(key=lambda row: -(row["ttft_p99_s"] or 0.0))
        return rows

    @staticmethod
    def _live_row(req: Request, engine_now: float) -> dict:
        return {
            "request_id": req.request_id,
            "robot_id": req.robot_id,
            "priority": req.priority.value,
            "state": "running" if req.status == RequestStatus.RUNNING else "waiting",
            "prompt_tokens": req.num_prompt_tokens,
            "output_tokens": req.num_output_tokens,
            "age_s": engine_now - req.arrival_time,
        }


def robot_view(snapshot: dict, robot_id: str) -> dict:
    """A ``snapshot`` as one robot may see it: the fleet's aggregates, and of the per-robot and
    per-request rows only its own (no other robot's ids or request ids)."""
    mine = {key: [row for row in snapshot[key] if row["robot_id"] == robot_id] for key in ("robots", "running", "recent")}
    return {**snapshot, **mine}
