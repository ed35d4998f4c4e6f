"""HiCache settings: the host and disk tiers below the device KV pool (``[hicache]`` table)."""

from __future__ import annotations

from dataclasses import dataclass

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass(frozen=True)
class HiCacheConfig:
    enabled: bool = False
    # write_through: back up every computed page; write_through_selective: back up pages hit
    # at least `write_through_threshold` times; write_back: copy down only on device eviction.
    write_policy: str = "write_through"
    write_through_threshold: int = 2
    host_pool_mb: float = 1024.0  # host tier size (pinned on a GPU machine)
    disk_dir: str = ""  # "" = no disk tier; pages are files keyed by their content hash chain
    # the disk tier's bound (> 0: an unbounded one filled 992 MB in 50k prompt tokens); beyond it
    # the least recently used pages go
    disk_max_mb: float = 4096.0
    # Cost model: a lower-tier hit shorter than this is recomputed, never loaded; longer ones
    # load only when the estimated copy time beats the estimated recompute time.
    min_load_tokens: int = 64
    prefetch: bool = True  # disk -> host when a request is queued, while the host has room
    # Layer-by-layer loads of host pages: the request starts at once and each layer of its
    # forward waits only for that layer's copy. "auto": on a GPU (the copy is asynchronous
    # there, so nothing blocks); on a CPU a waiting layer blocks the step, so "auto" keeps
    # loads whole (the request waits in WAITING_FOR_TIER_LOAD). "on" / "off" force it.
    layerwise_load: str = "auto"

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {', '.join(WRITE_POLICIES)}, got {self.write_policy!r}")
        if self.write_through_threshold < 1:
            raise ValueError(f"write_through_threshold must be >= 1, got {self.write_through_threshold}")
        if not self.host_pool_mb > 0:
            raise ValueError(f"host_pool_mb must be > 0, got {self.host_pool_mb}")
        if not self.disk_max_mb > 0:  # NaN fails too
            raise ValueError(f"disk_max_mb must be > 0 (the disk tier is always bounded), got {self.disk_max_mb}")
        if self.min_load_tokens < 0:
            raise ValueError(f"min_load_tokens must be >= 0, got {self.min_load_tokens}")
        if self.layerwise_load not in ("auto", "on", "off"):
            raise ValueError(f"layerwise_load must be 'auto', 'on' or 'off', got {self.layerwise_load!r}")

    def layerwise_for(self, on_gpu: bool) -> bool:
        """Whether loads run layer by layer for a KV pool on a GPU (``on_gpu``) or a CPU."""
        return self.layerwise_load == "on" or (self.layerwise_load == "auto" and on_gpu)
