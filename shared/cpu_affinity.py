"""Which CPUs a process runs on: Linux CPU lists (``0-3,6``) and pinning this process to a set.

A robot and its cloud never share a CPU when deployed. ``edged plan-eval --robot-cpus`` gives
each its own CPUs on one machine: this process (the robot's side) is pinned with ``pinned``, the
cloud it starts with ``DaemonProcess(cpus=...)``. Thread pools (torch's OpenMP, ONNX Runtime's)
size themselves from the affinity mask they start under.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator


def available_cpus() -> frozenset[int]:
    """The CPUs this process may run on now (its affinity mask)."""
    return frozenset(os.sched_getaffinity(0))


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-2,5"`` -> {0, 1, 2, 5} (the kernel's cpulist form). ValueError for an empty list, a
    negative or malformed number, or a range that runs backwards."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"CPU list {text!r}: expected numbers and ranges such as 0-2,5")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise ValueError(f"CPU list {text!r}: range {part.strip()} runs backwards")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The shortest cpulist for ``cpus``: {0, 1, 2, 5} -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in runs)


@contextlib.contextmanager
def pinned(cpus: frozenset[int]) -> Iterator[None]:
    """Every thread of this process runs on ``cpus`` (and the threads they start, which inherit
    the mask) until the block ends; then each thread that is still running gets its own mask back.
    Threads started inside keep ``cpus``. ValueError for a CPU this process may not use."""
    outside = cpus - available_cpus()
    if not cpus or outside:
        raise ValueError(f"CPUs {format_cpu_list(outside) or 'none'}: not among this process's "
                         f"{format_cpu_list(available_cpus())}")
    before: dict[int, set[int]] = {}
    try:  # NOTE: a thread that refuses the mask (OSError) leaves none of the others pinned
        for tid in _threads():
            with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
                before[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, cpus)
        yield
    finally:
        for tid, mask in before.items():
            _set_affinity(tid, mask)


def _threads() -> list[int]:
    return [int(tid) for tid in os.listdir("/proc/self/task")]


def _set_affinity(tid: int, cpus: Iterable[int]) -> None:
    with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
        os.sched_setaffinity(tid, cpus)
