"""Load or recompute? A lower-tier hit is loaded only when copying it is cheaper.

Recompute time is the engine's measured step cost for that many tokens (`ServiceRate`); load
time is a fixed latency plus bytes over bandwidth per tier, refined from the copies observed.
Hits shorter than ``min_load_tokens`` are always recomputed (a config threshold: a short
segment costs a step's worth of waiting for almost nothing).
"""

from __future__ import annotations

from collections.abc import Callable

from shared.engine.kv.tier_ops import Tier

_EWMA = 0.2  # weight of a new observation
# Starting guesses, replaced by observations: memcpy-class host copies, SSD-class disk reads.
_BANDWIDTH = {Tier.HOST: 2e9, Tier.DISK: 3e8}  # bytes/s
_LATENCY_S = {Tier.HOST: 1e-4, Tier.DISK: 1e-3}


class LoadCostModel:
    def __init__(self, min_load_tokens: int, page_bytes: int, page_size: int,
                 recompute_seconds: Callable[[int], float]) -> None:
        self.min_load_tokens = min_load_tokens
        self.page_bytes = page_bytes
        self.page_size = page_size
        self.recompute_seconds = recompute_seconds  # tokens -> measured seconds to compute them
        self.bandwidth = dict(_BANDWIDTH)

    def observe(self, tier: Tier, num_bytes: int, seconds: float) -> None:
        """A copy of ``num_bytes`` from ``tier`` took ``seconds`` (ignored when too small to time)."""
        if num_bytes <= 0 or seconds <= 1e-5:
            return
        self.bandwidth[tier] = (1 - _EWMA) * self.bandwidth[tier] + _EWMA * num_bytes / seconds

    def load_seconds(self, host_pages: int, disk_pages: int) -> float:
        """Estimated time to bring these pages to the device."""
        disk = _LATENCY_S[Tier.DISK] + disk_pages * self.page_bytes / self.bandwidth[Tier.DISK] if disk_pages else 0.0
        host = (host_pages + disk_pages) * self.page_bytes / self.bandwidth[Tier.HOST]
        return _LATENCY_S[Tier.HOST] + host + disk

    def worth_loading(self, num_tokens: int, host_pages: int, disk_pages: int) -> bool:
        """True when loading ``num_tokens`` (in these pages) beats recomputing them."""
        if num_tokens < max(self.min_load_tokens, 1):
            return False
        recompute = self.recompute_seconds(num_tokens)
        if recompute <= 0:  # nothing measured yet: trust the threshold
            return True
        return self.load_seconds(host_pages, disk_pages) < recompute
