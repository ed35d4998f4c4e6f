"""The four modes of ``cloudd bench`` and the flags each one reads.

A flag set (away from its default) for a mode that does not read it is an error, not silence: an
operator who adds ``--profile`` to an ``--online`` run, or ``--config`` to a ``--serve`` replay of
someone else's server, must not read a report that quietly left the flag out. A flag given at its
default changes nothing, so it passes. Flags are argparse dests.
"""

from __future__ import annotations

from dataclasses import dataclass

from cloudd.assembly import ENGINE_ARGS


@dataclass(frozen=True)
class BenchMode:
    """One way ``cloudd bench`` runs; ``name`` is how errors call it, ``reads`` its flags."""

    name: str
    reads: frozenset[str]

    def check_given(self, given: set[str]) -> None:
        """ValueError naming every flag in ``given`` this mode does not read."""
        unread = sorted(given - self.reads)
        if unread:
            flags = ", ".join("--" + dest.replace("_", "-") for dest in unread)
            raise ValueError(f"{self.name} does not use {flags}: leave {'it' if len(unread) == 1 else 'them'} out")


_EVERY_MODE = {"limit", "json"}

IN_PROCESS = BenchMode("bench (in-process replay)", frozenset(
    _EVERY_MODE | set(ENGINE_ARGS) | {"trace", "index", "response_format", "baseline", "peers_dir", "baseline_batch",
                                      "output_len", "robots", "tiers", "device_pool_frac", "no_progress", "profile"}))
SERVE = BenchMode("bench --serve", frozenset(_EVERY_MODE | {"serve", "trace", "rate_scale"}))
CLUSTER = BenchMode("bench --cluster", frozenset(
    _EVERY_MODE | set(ENGINE_ARGS) | {"cluster", "trace", "output_len", "rate_scale", "device_pool_frac", "replicas",
                                      "router"}))
ONLINE = BenchMode("bench --online", frozenset(
    _EVERY_MODE | set(ENGINE_ARGS) | {"online", "baseline", "peers_dir", "output_len", "request_rate", "pairs"}))


def bench_mode(online: bool, serve: bool, cluster: bool) -> BenchMode:
    """The mode the command line asks for (``--online`` first, then ``--serve``, then ``--cluster``;
    the mode's ``check_given`` refuses a second one)."""
    if online:
        return ONLINE
    if serve:
        return SERVE
    return CLUSTER if cluster else IN_PROCESS
