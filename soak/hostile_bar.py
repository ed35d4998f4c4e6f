"""The hostile-tenant phase's bar, as pure functions of what the victim measured.

A *gap* is one inter-token wait of the victim robot: from each chunk of its stream to the next
(the issue's bar is on inter-token gaps). A wait still open when a window ends counts too, up to
the window's end, whether or not its plan had a first chunk yet, so a victim stuck for the whole
window is not a victim with no gaps. The waits for each plan's first chunk (its prefill, a few per
window: too few for a p99 of their own) are reported beside the gaps (``*_first_chunk_max_s``).

Per attack kind the bar is: the victim's p99 gap during the attack at most ``GAP_RATIO`` times
its p99 gap with no attacker, no daemon crashed, no victim request lost (no answer), and none
refused (a typed error instead of a plan: a robot refused because of another's traffic was
denied service, which gaps alone would hide). HTTP kinds also probe the HTTP API as a tenant
would; each probe not answered 200 counts as refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

GAP_RATIO = 2.0  # the bar: victim p99 gap <= 2x its no-attacker p99 gap


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) of ``values`` by the nearest-rank rule (the smallest value with
    at least ``q`` of the values at or below it); None for no values."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass(frozen=True)
class KindResult:
    """One attack kind's figures and its verdict (``passed``)."""

    kind: str
    victim_gaps: tuple[float, ...]
    baseline_gaps: tuple[float, ...]
    victim_first_chunk_waits: tuple[float, ...] = ()
    baseline_first_chunk_waits: tuple[float, ...] = ()
    crashes: int = 0  # daemon exits during this kind
    lost: int = 0  # victim requests with no answer
    refused: int = 0  # victim requests (or HTTP tenant probes) answered with an error

    @property
    def victim_gap_p99_s(self) -> float | None:
        return percentile(self.victim_gaps, 0.99)

    @property
    def baseline_gap_p99_s(self) -> float | None:
        return percentile(self.baseline_gaps, 0.99)

    @property
    def ratio(self) -> float | None:
        victim, baseline = self.victim_gap_p99_s, self.baseline_gap_p99_s
        if victim is None or not baseline:
            return None
        return victim / baseline

    @property
    def passed(self) -> bool:
        """Within the bar; a window with no gaps measured (the victim never got a chunk) fails."""
        return (self.ratio is not None and self.ratio <= GAP_RATIO and self.crashes == 0 and self.lost == 0
                and self.refused == 0)

    def as_dict(self) -> dict:
        def rounded(x: float | None) -> float | None:
            return None if x is None else round(x, 4)
        return {"victim_gap_p99_s": rounded(self.victim_gap_p99_s),
                "baseline_gap_p99_s": rounded(self.baseline_gap_p99_s), "ratio": rounded(self.ratio),
                "victim_gaps": len(self.victim_gaps), "baseline_gaps": len(self.baseline_gaps),
                "victim_gap_max_s": rounded(max(self.victim_gaps, default=None)),
                "victim_first_chunk_max_s": rounded(max(self.victim_first_chunk_waits, default=None)),
                "baseline_first_chunk_max_s": rounded(max(self.baseline_first_chunk_waits, default=None)),
                "crashes": self.crashes, "lost": self.lost, "refused": self.refused, "passed": self.passed}


def verdict_lines(results: Sequence[KindResult]) -> list[str]:
    """PASS/FAIL per kind, then overall (FAIL with no kinds: nothing was shown)."""
    lines = []
    for r in results:
        d = r.as_dict()
        lines.append(f"hostile {r.kind}: {'PASS' if r.passed else 'FAIL'} victim p99 {d['victim_gap_p99_s']} s, "
                     f"baseline p99 {d['baseline_gap_p99_s']} s (x{d['ratio']}), crashes {r.crashes}, "
                     f"lost {r.lost}, refused {r.refused}")
    overall = bool(results) and all(r.passed for r in results)
    lines.append(f"hostile overall: {'PASS' if overall else 'FAIL'}")
    return lines
