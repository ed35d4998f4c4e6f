"""The cluster's ``stats`` reply: the replicas' snapshots (``cloudd.monitor``'s shape) merged
into one of the same shape, so fleetctl's views read it as they read one cloudd, plus
``cluster``: a row per replica (its id, pid, load, KV, cache hits, and what the router sent it)
and the router's decisions (by reason, robots moved between replicas, requests resumed)."""

from __future__ import annotations

from collections.abc import Sequence

SUMMED_ENGINE = ("running", "waiting", "kv_blocks_used", "kv_blocks_total", "kv_blocks_in_requests", "prompt_tokens",
                 "cache_hit_tokens", "cached_tokens", "preemptions", "deadline_misses", "steps")


def merge_snapshots(replicas: Sequence[dict], router: dict, resumed: int, state: str) -> dict:
    """``replicas``: each replica's snapshot with ``replica`` and ``pid``; ``router``:
    ``FleetRouting.snapshot()``."""
    routed = router.get("replicas", {})
    rows = [{"replica": s["replica"], "pid": s["pid"], "state": s.get("state"),
             **{k: s["engine"][k] for k in ("running", "waiting", "kv_blocks_used", "kv_blocks_total",
                                              "prefix_hit_rate")},
             "output_tok_s": s["throughput"]["output_tok_s"],
             **{k: routed.get(s["replica"], {}).get(k, 0) for k in ("in_flight", "routed", "prefix_hits")}}
            for s in replicas]
    cluster = {"replicas": rows, "router": {k: router.get(k) for k in ("policy", "decisions", "moves")},
               "resumed": resumed}
    if not replicas:
        return {"state": state, "cluster": cluster}
    first = replicas[0]
    engine = {k: sum(s["engine"][k] for s in replicas) for k in SUMMED_ENGINE}
    engine["prefix_hit_rate"] = engine["cache_hit_tokens"] / engine["prompt_tokens"] if engine["prompt_tokens"] else 0.0
    return {
        **first,
        "state": state,
        "uptime_s": max(s["uptime_s"] for s in replicas),
        "throughput": {k: sum(s["throughput"][k] for s in replicas) if k != "window_s" else first["throughput"][k]
                       for k in first["throughput"]},
        "engine": {**first["engine"], **engine},
        "queue": {c: {k: sum(s["queue"][c][k] for s in replicas) for k in first["queue"][c]} for c in first["queue"]},
        "totals": {k: sum(s["totals"][k] for s in replicas) for k in first["totals"]},
        "robots": _robots(replicas),
        "running": [row for s in replicas for row in s["running"]],
        "recent": [row for s in replicas for row in s["recent"]][:50],  # each replica's newest first
        "cluster": cluster,
    }


def _robots(replicas: Sequence[dict]) -> list[dict]:
    """A robot served by several replicas: its counts summed, its worst latencies, its latest sighting."""
    merged: dict[str, dict] = {}
    for s in replicas:
        for row in s["robots"]:
            seen = merged.get(row["robot_id"])
            if seen is None:
                merged[row["robot_id"]] = dict(row)
                continue
            for k in ("requests", "live", "output_tokens"):
                seen[k] += row[k]
            for k in ("ttft_p50_s", "ttft_p99_s"):
                seen[k] = max((v for v in (seen[k], row[k]) if v is not None), default=None)
            seen["last_seen_s"] = min((v for v in (seen["last_seen_s"], row["last_seen_s"]) if v is not None),
                                      default=None)
    return sorted(merged.values(), key=lambda r: -(r["ttft_p99_s"] or 0))
