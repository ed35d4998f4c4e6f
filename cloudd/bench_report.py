"""Latency records and the bench report (ARCHITECTURE §6 key names)."""

from __future__ import annotations

import resource
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestTiming:
    """One request's latencies, in seconds from when the replay submitted it."""

    priority: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    e2e_s: float

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first."""
        return (self.e2e_s - self.ttft_s) / max(self.output_tokens - 1, 1)


def percentiles(values: list[float]) -> dict[str, float]:
    """p50 / p99 (nearest rank) and mean."""
    if not values:
        return {"p50": 0.0, "p99": 0.0, "mean": 0.0}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]

    return {"p50": rank(0.50), "p99": rank(0.99), "mean": sum(ordered) / len(ordered)}


def latency_summary(timings: list[RequestTiming]) -> dict:
    return {
        "requests": len(timings),
        "ttft_s": percentiles([t.ttft_s for t in timings]),
        "tpot_s": percentiles([t.tpot_s for t in timings]),
        "e2e_s": percentiles([t.e2e_s for t in timings]),
    }


def run_report(trace: str, timings: list[RequestTiming], wall_s: float, prefix_hit_rate: float) -> dict:
    """The §6 object for one run."""
    out_tokens = sum(t.output_tokens for t in timings)
    all_tokens = out_tokens + sum(t.prompt_tokens for t in timings)
    by_priority = {
        str(p): latency_summary([t for t in timings if t.priority == p])
        for p in sorted({t.priority for t in timings})
    }
    return {
        "trace": trace,
        **latency_summary(timings),
        "output_tok_s": out_tokens / wall_s,
        "total_tok_s": all_tokens / wall_s,
        "wall_s": wall_s,
        "output_tokens": out_tokens,
        "prompt_tokens": all_tokens - out_tokens,
        "prefix_hit_rate": prefix_hit_rate,
        "peak_rss_mb": peak_rss_mb(),
        "by_priority": by_priority,
    }


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def format_run(name: str, r: dict) -> str:
    """One human-readable block for stdout."""
    t, p, e = r["ttft_s"], r["tpot_s"], r["e2e_s"]
    lines = [
        f"== {name}: {r['requests']} requests, {r['output_tokens']} output tokens in {r['wall_s']:.1f} s",
        f"   output {r['output_tok_s']:.1f} tok/s   total {r['total_tok_s']:.1f} tok/s"
        f"   prefix hit {100 * r['prefix_hit_rate']:.1f}%   peak RSS {r['peak_rss_mb']:.0f} MB",
        f"   TTFT p50 {t['p50']:.2f}s p99 {t['p99']:.2f}s   TPOT p50 {1000 * p['p50']:.0f}ms"
        f" p99 {1000 * p['p99']:.0f}ms   e2e p50 {e['p50']:.2f}s p99 {e['p99']:.2f}s",
    ]
    if "tiers" in r:
        t = r["tiers"]
        hits, moved = t["hit_tokens"], t["bytes_moved"]
        lines.append(f"   tier hits: device {hits['device']:,} host {hits['host']:,} disk {hits['disk']:,} tokens"
                     f"   loads {t['loads']} (mean {1000 * t['load_mean_s']:.1f} ms, {t['loads_skipped']} skipped,"
                     f" {t['loads_layerwise']} layer by layer,"
                     f" {t['load_failures']} failed)   moved D>H {moved['device_to_host'] / 2**20:,.0f} MB"
                     f" H>D {moved['host_to_device'] / 2**20:,.0f} MB H>disk {moved['host_to_disk'] / 2**20:,.0f} MB"
                     f" disk>H {moved['disk_to_host'] / 2**20:,.0f} MB")
    if "ratio" in r:
        lines.append(f"   {r['ratio']:.2f}x the HF transformers baseline's output tok/s")
    return "\n".join(lines)


def format_peer_run(name: str, r: dict) -> str:
    """A peer's block: throughput and reuse only (a peer reports no per-request latencies)."""
    return "\n".join([
        f"== {name}: {r.get('requests', '?')} requests, {r.get('output_tokens', '?')} output tokens"
        f" in {r['wall_s']:.1f} s",
        f"   output {r['output_tok_s']:.1f} tok/s   total {r['total_tok_s']:.1f} tok/s"
        f"   prefix hit {100 * r['prefix_hit_rate']:.1f}%",
    ])


def format_profile(profile: dict) -> str:
    """Where a run's step time went (``StepProfile.report``), for stderr."""
    ms, share = profile["ms_per_step"], profile["share"]
    phases = "  ".join(f"{k} {ms[k]:.1f}ms ({share[k]:.0%})" for k in ms)
    lines = [f"   profile over {profile['steps']} steps: {phases}",
             f"   host {profile['host_ms_per_step']:.1f} ms/step   model {profile['achieved_gflop_s']:.0f} GFLOP/s"]
    if "peak_frac" in profile:
        lines[-1] += f" = {profile['peak_frac']:.0%} of the {profile['peak_gflop_s']:.0f} GFLOP/s matmul peak"
    if "cpu" in profile:
        lines.append(f"   cpu {profile['cpu']}")
    if profile.get("operations"):
        lines.append("   operations: " + "  ".join(f"{op}={o['implementation']} ({o['phase']} {o['share']:.0%})"
                                                   for op, o in profile["operations"].items()))
    return "\n".join(lines)
