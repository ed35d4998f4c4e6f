"""``cloudd cluster serve``: Ray up (local on loopback, or joined), the replicas deployed with the
fleet router and the autoscaling policy, the front (ZeroMQ protocol) and the OpenAI HTTP API in
front of them; a clean stop on SIGTERM/SIGINT."""

from __future__ import annotations

import dataclasses
import logging
import signal

from cloudd.cluster.config import ClusterConfig
from cloudd.cluster.ray_runtime import APP_NAME, import_ray, start_ray, stop_ray
from cloudd.cluster.routing import RoutingConfig

log = logging.getLogger(__name__)


def routing_config(cluster: ClusterConfig) -> RoutingConfig:
    return RoutingConfig(policy=cluster.router, imbalance_abs=cluster.imbalance_abs,
                         imbalance_rel=cluster.imbalance_rel, hash_load_factor=cluster.hash_load_factor,
                         pages_per_replica=cluster.prefix_pages_per_replica)


def deploy(cluster: ClusterConfig, serve_args: dict, app_name: str = APP_NAME):
    """Run the replicas as Serve application ``app_name`` (Ray must be up); returns their
    deployment handle once all are ready. A process keeps one router per application: a
    redeployment with another ``router`` needs another name."""
    _, serve = import_ray()
    return serve.run(application(cluster, serve_args), name=app_name, route_prefix=None)


def application(cluster: ClusterConfig, serve_args: dict):
    """The replicas' Serve application (``EngineReplica`` with its options, bound to
    ``serve_args``), not yet running: what ``deploy`` runs and ``serve build`` describes."""
    _, serve = import_ray()
    from ray.serve.config import RequestRouterConfig

    from cloudd.cluster.ray_router import FleetRequestRouter
    from cloudd.cluster.replica import EngineReplica

    options = {
        "ray_actor_options": {"num_cpus": cluster.num_cpus_per_replica, "num_gpus": cluster.num_gpus_per_replica},
        "max_ongoing_requests": cluster.max_ongoing_requests,
        "health_check_period_s": cluster.health_check_period_s,
        "health_check_timeout_s": cluster.health_check_timeout_s,
        "request_router_config": RequestRouterConfig(
            request_router_class=FleetRequestRouter,
            request_router_kwargs=dataclasses.asdict(routing_config(cluster))),
    }
    if cluster.autoscaling:
        options["autoscaling_config"] = {
            "min_replicas": cluster.lowest, "max_replicas": cluster.highest, "initial_replicas": cluster.replicas,
            "upscale_delay_s": cluster.upscale_delay_s, "downscale_delay_s": cluster.downscale_delay_s,
            "policy": {"policy_function": "cloudd.cluster.autoscaling:FleetAutoscaling",
                       "policy_kwargs": {"target_queue_depth": cluster.target_queue_depth,
                                         "target_kv_usage": cluster.target_kv_usage}},
        }
    else:
        options["num_replicas"] = cluster.replicas
    threads = max(1, round(cluster.num_cpus_per_replica))
    return serve.deployment(EngineReplica, name="EngineReplica").options(**options).bind(serve_args, threads)


def serve_cluster(cluster: ClusterConfig, serve_args: dict, model_path, ports: dict[str, int | None],
                  serve_config) -> int:
    """``serve_config``: cloudd's ``[serve]`` table: the front's ports, keys, quotas and limits,
    as ``cloudd serve`` takes them (the front is the same request front)."""
    from cloudd.cluster.front import ClusterFront
    from cloudd.http_api import start_http_api
    from cloudd.metrics import ServerMetrics
    from shared.model.checkpoint import load_tokenizer

    serve_config = dataclasses.replace(serve_config, **{k: v for k, v in ports.items() if v is not None})
    tokenizer = load_tokenizer(model_path)
    started_here = start_ray(cluster)
    try:
        handle = deploy(cluster, serve_args)
        front = ClusterFront(handle, APP_NAME, dataclasses.replace(serve_config.front(), daemon="cloudd cluster"),
                             cluster.resume_retries, model_name=model_path.stem, replicas=cluster.replicas,
                             dispatch_per_replica=cluster.dispatch_per_replica,
                             count_prompt=lambda msg: len(tokenizer.encode_chat([m.as_dict() for m in msg.messages])))
        http = start_http_api(serve_config, front, tokenizer, ServerMetrics(serve_config.max_robot_labels),
                              model_path.stem)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: front.stop())
        signal.signal(signal.SIGHUP, lambda *_: (front.reload_keys(), http.reload_keys()))
        host, port = http.server.server_address[:2]
        print(f"cloudd cluster ready: zmq={front.endpoint} http=http://{host}:{port} replicas={cluster.replicas} "
              f"router={cluster.router} ray={'local' if started_here else cluster.address}", flush=True)
        try:
            front.serve_forever()
        finally:
            http.close()
    finally:
        stop_ray(started_here)
    print("cloudd cluster: stopped", flush=True)
    return 0
