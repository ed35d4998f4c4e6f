"""``cloudd bench --cluster``: the same requests through N replicas under each router, and
through one replica, for the prefix hit rate the router keeps (and throughput, latency).

For each ``--router`` variant, then once with a single replica, a fresh deployment (cold
replicas: empty caches) serves a replay of the trace at its arrival times (``rate_scale``
faster) through an in-process front, with ``cloudd bench --serve``'s client
(``cloudd.serve_bench``). The hit rate is the replicas' cache-hit over prompt tokens during the
run. Run it where Ray may listen (``make bench-cluster`` wraps it in a loopback-only network
namespace).
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

from cloudd.cluster.app import deploy
from cloudd.cluster.config import ClusterConfig
from cloudd.cluster.front import ClusterFront
from cloudd.cluster.ray_runtime import import_ray, start_ray, stop_ray
from cloudd.serve_bench import Log, ServeBenchOptions, format_serve_run, load_requests, report, run_one
from cloudd.server import ServeConfig


@dataclasses.dataclass(frozen=True)
class ClusterBenchOptions:
    trace: Path
    cluster: ClusterConfig
    routers: tuple[str, ...]
    serve_args: dict  # the replicas' engine arguments (as `cloudd cluster serve` passes them)
    output_len: int | None = None  # every request's max_tokens (None: the trace's)
    limit: int | None = None
    rate_scale: float = 1.0


def run_cluster_bench(opts: ClusterBenchOptions, log: Log) -> dict:
    """``{"runs": {router: report}, "single_replica": report, "single_replica_prefix_hit_rate":
    float, "replicas": n}``; each report is ``cloudd bench --serve``'s object."""
    requests = load_requests(opts.trace, opts.limit)
    if opts.output_len is not None:
        requests = [dataclasses.replace(r, max_tokens=opts.output_len) for r in requests]
    started_here = start_ray(opts.cluster)
    try:
        runs = {}
        for router in opts.routers:
            runs[router] = _one_run(dataclasses.replace(opts.cluster, router=router), opts, requests, log)
        single = _one_run(dataclasses.replace(opts.cluster, replicas=1, min_replicas=0, max_replicas=0), opts,
                          requests, log)
    finally:
        stop_ray(started_here)
    result = {"trace": str(opts.trace), "requests": len(requests), "replicas": opts.cluster.replicas,
              "runs": runs, "single_replica": single,
              "single_replica_prefix_hit_rate": single["prefix_hit_rate"]}
    for router, r in runs.items():
        log(f"{router}: prefix hit {r['prefix_hit_rate']:.3f} ({r['prefix_hit_rate'] - single['prefix_hit_rate']:+.3f}"
            f" vs one replica), {r['output_tok_s']:.1f} output tok/s, decisions {r['router']['decisions']}, "
            f"robots moved {r['router']['moves']}")
    return result


def _one_run(cluster: ClusterConfig, opts: ClusterBenchOptions, requests, log: Log) -> dict:
    """Deploy cold replicas, replay through a front, report, remove the deployment."""
    _, serve = import_ray()
    name = f"{cluster.replicas} replicas, router {cluster.router}" if cluster.replicas > 1 else "1 replica"
    log(f"{name}: starting")
    app_name = f"bench-{cluster.replicas}-{cluster.router}"  # NOTE: Ray keeps a process's router per application
    handle = deploy(cluster, opts.serve_args, app_name)
    front = ClusterFront(handle, app_name, ServeConfig(zmq_port=0).front(), cluster.resume_retries, model_name="bench")
    thread = threading.Thread(target=front.serve_forever, name="cluster-front", daemon=True)
    thread.start()
    try:
        bench = ServeBenchOptions(opts.trace, (front.endpoint,), opts.rate_scale, opts.limit)
        r = report(opts.trace, run_one(front.endpoint, requests, bench, log))
        r["router"] = front.routing.snapshot() if front.routing is not None else None
        r["resumed"] = front.resumed
        log(format_serve_run({**r, "policy": name}))
        return r
    finally:
        front.stop()
        thread.join()
        serve.delete(app_name)
