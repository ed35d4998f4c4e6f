"""``cloudd bench --cluster``: the same requests through N replicas under each router, and
through one replica, for the prefix hit rate the router keeps (and throughput, latency).

For each ``--router`` variant, then once with a single replica, a fresh deployment (cold
replicas: empty caches) serves a replay of the trace at its arrival times (``rate_scale``
faster) through an in-process front, with ``cloudd bench --serve``'s client
(``cloudd.serve_bench``). The hit rate is the replicas' cache-hit over prompt tokens during the
run. Run it where Ray may listen (``make bench-cluster`` wraps it in a loopback-only network
namespace).

With ``device_pool_frac`` each replica's KV pool is that fraction of the replayed prompts'
working set (``cloudd.working_set``, as the single-engine bench sizes it), the single replica
gets the replicas' pools combined (``combined_pool_prefix_hit_rate``: what two replicas would be
if routing lost nothing), and ``predicted`` holds the bounded-LRU replay of the same prompts
(``cloudd.cluster.lru_replay``) for comparison. That replica is sent the trace at 1/N of the
routers' rate (N replicas): each of them served about 1/N of the requests, so it carries the load
per replica they did. At the full rate one replica falls minutes behind, runs dozens of requests
at once, and their blocks push out what its cache would have kept: it would measure falling
behind, not memory. Its throughput figures are therefore at that rate (``single_replica``'s
``rate_scale``), not comparable to the routers'.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

from cloudd.cluster.app import deploy
from cloudd.cluster.lru_replay import BoundedReuse, bounded_reuse
from cloudd.cluster.config import ClusterConfig
from cloudd.cluster.front import ClusterFront
from cloudd.cluster.ray_runtime import import_ray, start_ray, stop_ray
from cloudd.serve_bench import Log, ServeBenchOptions, format_serve_run, load_requests, report, run_one
from cloudd.server import ServeConfig
from cloudd.trace import TraceRequest
from cloudd.working_set import pool_blocks, pool_tokens, working_set_tokens
from shared.engine.engine_config import EngineConfig
from shared.model.checkpoint import load_tokenizer


# The replay is one operator's client sending a whole fleet's requests: no per-robot or per-sender
# limits, and every class (the traces' urgent requests are safety), so the routers alone differ.
BENCH_FRONT = ServeConfig(zmq_port=0).admitting_all()


@dataclasses.dataclass(frozen=True)
class ClusterBenchOptions:
    trace: Path
    cluster: ClusterConfig
    routers: tuple[str, ...]
    serve_args: dict  # the replicas' engine arguments (as `cloudd cluster serve` passes them)
    output_len: int | None = None  # every request's max_tokens (None: the trace's)
    limit: int | None = None
    rate_scale: float = 1.0
    device_pool_frac: float | None = None  # each replica's KV pool as a fraction of the working set


def run_cluster_bench(opts: ClusterBenchOptions, log: Log) -> dict:
    """``{"runs": {router: report}, "single_replica": report, "single_replica_prefix_hit_rate":
    float, "replicas": n}``; each report is ``cloudd bench --serve``'s object plus the
    ``rate_scale`` it was replayed at. With ``device_pool_frac`` the single replica's rate is
    ``combined_pool_prefix_hit_rate`` instead (that replica replayed at ``rate_scale / n``),
    beside ``pool`` (the sizes) and ``predicted`` (the bounded-LRU replay's rates)."""
    requests = load_requests(opts.trace, opts.limit)
    if opts.output_len is not None:
        requests = [dataclasses.replace(r, max_tokens=opts.output_len) for r in requests]
    pools = None if opts.device_pool_frac is None else _size_pools(opts, requests, log)
    replica_args = opts.serve_args if pools is None else {**opts.serve_args, "num_blocks": pools.replica_blocks + 1}
    single_args = opts.serve_args if pools is None else {**opts.serve_args, "num_blocks": pools.combined_blocks + 1}
    started_here = start_ray(opts.cluster)
    try:
        runs = {}
        for router in opts.routers:
            runs[router] = _one_run(dataclasses.replace(opts.cluster, router=router), replica_args, opts, requests, log)
        single_rate = opts.rate_scale if pools is None else opts.rate_scale / opts.cluster.replicas
        single = _one_run(dataclasses.replace(opts.cluster, replicas=1, min_replicas=0, max_replicas=0), single_args,
                          dataclasses.replace(opts, rate_scale=single_rate), requests, log)
    finally:
        stop_ray(started_here)
    single_key = "single_replica_prefix_hit_rate" if pools is None else "combined_pool_prefix_hit_rate"
    result = {"trace": str(opts.trace), "requests": len(requests), "replicas": opts.cluster.replicas,
              "runs": runs, "single_replica": single, single_key: single["prefix_hit_rate"]}
    if pools is not None:
        pool = {"working_set_tokens": pools.working_set_tokens, "replica_blocks": pools.replica_blocks,
                "combined_blocks": pools.combined_blocks}
        result |= {"pool": pool, "predicted": dataclasses.asdict(pools.predicted)}
    for router, r in runs.items():
        log(f"{router}: prefix hit {r['prefix_hit_rate']:.3f} ({r['prefix_hit_rate'] - single['prefix_hit_rate']:+.3f}"
            f" vs one replica), {r['output_tok_s']:.1f} output tok/s, decisions {r['router']['decisions']}, "
            f"robots moved {r['router']['moves']}")
    return result


@dataclasses.dataclass(frozen=True)
class ReplicaPools:
    """The KV pools of a ``device_pool_frac`` run, in blocks, and what the replay predicts for them."""

    working_set_tokens: int
    replica_blocks: int
    combined_blocks: int
    predicted: BoundedReuse


def _size_pools(opts: ClusterBenchOptions, requests: list[TraceRequest], log: Log) -> ReplicaPools:
    """Each replica's pool from the prompts as the replicas' tokenizer encodes them."""
    tokenizer = load_tokenizer(opts.serve_args["model"])
    block_size = opts.serve_args.get("block_size") or EngineConfig().block_size
    prompts = [tokenizer.encode_chat(list(r.messages)) for r in requests]
    ws = working_set_tokens(prompts)
    longest = max(len(p) + r.max_tokens for p, r in zip(prompts, requests, strict=True))
    blocks = pool_blocks(pool_tokens(opts.device_pool_frac, ws, longest), block_size)
    replicas = opts.cluster.replicas
    predicted = bounded_reuse(prompts, [r.robot for r in requests], replicas, opts.device_pool_frac, blocks,
                              block_size)
    log(f"working set {ws:,} tokens: {blocks:,} blocks of {block_size} per replica, {replicas * blocks:,} for the "
        f"combined-pool replica; the LRU replay predicts random {predicted.random:.3f}, pow2 {predicted.pow2:.3f}, "
        f"robot affinity {predicted.robot:.3f}, combined {predicted.combined:.3f}")
    return ReplicaPools(ws, blocks, replicas * blocks, predicted)


def _one_run(cluster: ClusterConfig, serve_args: dict, opts: ClusterBenchOptions, requests, log: Log) -> dict:
    """Deploy cold replicas, replay through a front, report, remove the deployment."""
    _, serve = import_ray()
    name = f"{cluster.replicas} replicas, router {cluster.router}" if cluster.replicas > 1 else "1 replica"
    log(f"{name}: starting")
    app_name = f"bench-{cluster.replicas}-{cluster.router}"  # NOTE: Ray keeps a process's router per application
    handle = deploy(cluster, serve_args, app_name)
    front = ClusterFront(handle, app_name, BENCH_FRONT.front(), cluster.resume_retries, model_name="bench",
                         replicas=cluster.replicas, dispatch_per_replica=cluster.dispatch_per_replica)
    thread = threading.Thread(target=front.serve_forever, name="cluster-front", daemon=True)
    thread.start()
    try:
        bench = ServeBenchOptions(opts.trace, (front.endpoint,), opts.rate_scale, opts.limit)
        r = report(opts.trace, run_one(front.endpoint, requests, bench, log))
        r["router"] = front.routing.snapshot() if front.routing is not None else None
        r["resumed"] = front.resumed
        r["rate_scale"] = opts.rate_scale
        log(format_serve_run({**r, "policy": name}))
        return r
    finally:
        front.stop()
        thread.join()
        serve.delete(app_name)
