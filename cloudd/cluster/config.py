"""The ``[cluster]`` table of ``configs/cluster.toml``: where Ray runs, how many replicas of
what size, the autoscaling bounds and the router."""

from __future__ import annotations

from dataclasses import dataclass

ROUTERS = ("fleet", "hash", "pow2")


@dataclass(frozen=True)
class ClusterConfig:
    # "" starts a local Ray instance on loopback only; "<head-ip>:6379" (the head's GCS) or "auto"
    # (this machine is a node of it) joins a cluster started with `ray start` (docs/cluster.md)
    address: str = ""
    replicas: int = 2  # replicas at start (and always, unless max_replicas > min_replicas)
    min_replicas: int = 0  # 0: = replicas
    max_replicas: int = 0  # above min_replicas: autoscaling between the two
    num_cpus_per_replica: float = 1.0  # Ray resources each replica reserves
    num_gpus_per_replica: float = 0.0  # 1 = one accelerator per replica
    max_ongoing_requests: int = 1024  # a replica takes no more at once (its engine queues the rest)
    # autoscaling: grow while replicas average more waiting requests than this or a fuller KV pool
    target_queue_depth: float = 16.0
    target_kv_usage: float = 0.85  # fraction of the KV pool in use
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 120.0
    router: str = "fleet"  # "fleet" (prefix + robot affinity, load guard) | "hash" | "pow2" (Ray's default)
    imbalance_abs: int = 16  # fleet router: least-loaded fallback when in-flight counts differ by more
    imbalance_rel: float = 1.5  # ... and the busiest has more than this many times the idlest's
    hash_load_factor: float = 1.25  # hash router: a replica takes at most this times the mean load
    prefix_pages_per_replica: int = 200_000  # fleet router: remembered prompt pages (64 chars) a replica
    resume_retries: int = 3  # a request whose replica dies is resumed on another this many times
    # the front lets each replica hold this many requests (running + its engine's queue); the rest
    # wait at the front, where each freed slot goes to the robot holding the fewest (fair admission)
    dispatch_per_replica: int = 256
    health_check_period_s: float = 2.0  # Ray's probe of each replica (a dead one restarts after it)
    health_check_timeout_s: float = 30.0
    ray_num_cpus: int = 0  # local Ray instance's CPUs (0: this machine's)
    ray_temp_dir: str = ""  # local Ray instance's session files ("": /tmp/fleetserve-ray)

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.replicas < 1 or self.min_replicas < 0 or self.max_replicas < 0:
            raise ValueError("replicas >= 1, min_replicas >= 0, max_replicas >= 0")
        if self.autoscaling and not self.lowest <= self.replicas <= self.highest:
            raise ValueError(f"replicas {self.replicas} must lie in [min_replicas, max_replicas] = "
                             f"[{self.lowest}, {self.highest}]")
        if self.num_cpus_per_replica < 0 or self.num_gpus_per_replica < 0 or self.max_ongoing_requests < 1:
            raise ValueError("num_cpus_per_replica >= 0, num_gpus_per_replica >= 0, max_ongoing_requests >= 1")
        if self.imbalance_abs < 0 or self.imbalance_rel < 1 or self.hash_load_factor <= 1:
            raise ValueError("imbalance_abs >= 0, imbalance_rel >= 1, hash_load_factor > 1")
        if self.dispatch_per_replica < 1:
            raise ValueError(f"dispatch_per_replica must be >= 1, got {self.dispatch_per_replica}")
        if self.resume_retries < 0 or self.health_check_period_s <= 0 or self.health_check_timeout_s <= 0:
            raise ValueError("resume_retries >= 0, health_check_period_s > 0, health_check_timeout_s > 0")
        if self.target_queue_depth <= 0 or not 0 < self.target_kv_usage <= 1:
            raise ValueError("target_queue_depth > 0, target_kv_usage in (0, 1]")

    @property
    def lowest(self) -> int:
        return self.min_replicas or self.replicas

    @property
    def highest(self) -> int:
        return max(self.max_replicas, self.lowest)

    @property
    def autoscaling(self) -> bool:
        return self.highest > self.lowest
