"""HiCache's counters (`HiCache.snapshot`), reported in engine stats, metrics and fleetctl."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TierStats:
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    bytes_moved: dict[str, int] = field(default_factory=lambda: {
        "device_to_host": 0, "host_to_device": 0, "host_to_disk": 0, "disk_to_host": 0})
    loads: int = 0
    loads_skipped: int = 0  # the cost model chose to recompute
    loads_layerwise: int = 0  # of `loads`, run layer by layer under their request's forward
    load_failures: int = 0  # pages that were missing, torn or corrupt (read as misses)
    copy_errors: int = 0  # ops that raised (a disk or device error, logged): their pages are forgotten
    load_s: float = 0.0  # summed request waits, submit to completion
    write_ops: int = 0
    write_s: float = 0.0  # summed worker time of backups and spills
    host_pages_used: int = 0
    host_pages_total: int = 0
    disk_pages: int = 0

    def as_dict(self) -> dict:
        d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}
        d["load_mean_s"] = self.load_s / self.loads if self.loads else 0.0
        d["write_mean_s"] = self.write_s / self.write_ops if self.write_ops else 0.0
        return d
