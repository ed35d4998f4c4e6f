"""What the soak harness watches while it fuzzes: a daemon's health latency, and its process's
memory, threads and file descriptors (read from ``/proc``)."""

from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import asdict, dataclass

import zmq

from shared.protocol.codec import decode, encode
from shared.protocol.messages import Health
from shared.transport.curve import ClientCurve

HEALTH_BOUND_MS = 100.0  # the bar: health answered within this, throughout


@dataclass(frozen=True)
class ProcessResources:
    rss_mb: float
    threads: int
    fds: int

    @classmethod
    def of(cls, pid: int) -> ProcessResources:
        fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status") if ":" in line)
        return cls(round(int(fields["VmRSS"].split()[0]) / 1024, 1), int(fields["Threads"]),
                   len(os.listdir(f"/proc/{pid}/fd")))


class HealthWatch:
    """Probes ``endpoint`` with ``health`` every ``every_s`` until stopped; a probe unanswered
    for ``timeout_s`` counts as failed. The prober is its own process, with its own socket: in
    the harness's process its timestamps would wait on the fuzzer's interpreter lock (building
    a 9 MB frame holds it for tens of milliseconds) and blame the daemon for the harness."""

    def __init__(self, endpoint: str, curve: ClientCurve | None = None, every_s: float = 0.05, timeout_s: float = 2.0):
        self.timeout_s = timeout_s
        self.latencies_ms: list[float] = []
        self.failures = 0
        context = multiprocessing.get_context("spawn")  # NOTE: not fork: the harness holds threads and sockets
        self._stop = context.Event()
        self._results, sender = context.Pipe(duplex=False)
        self._process = context.Process(target=_probe, name="health-watch", daemon=True,
                                        args=(endpoint, curve, every_s, timeout_s, self._stop, sender))

    def __enter__(self) -> HealthWatch:
        self._process.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._results.poll(self.timeout_s + 30):
            self.latencies_ms, self.failures = self._results.recv()
        self._process.join(5)
        if self._process.is_alive():
            self._process.kill()

    def summary(self) -> dict:
        ordered = sorted(self.latencies_ms)
        p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] if ordered else None
        return {"probes": len(ordered) + self.failures, "failures": self.failures,
                "max_ms": round(ordered[-1], 1) if ordered else None, "p99_ms": None if p99 is None else round(p99, 1),
                "over_bound": sum(ms > HEALTH_BOUND_MS for ms in ordered) + self.failures,
                "bound_ms": HEALTH_BOUND_MS}


def _probe(endpoint: str, curve: ClientCurve | None, every_s: float, timeout_s: float, stop, results) -> None:
    """The prober process: health every ``every_s`` until ``stop``; sends (latencies, failures)."""
    latencies_ms: list[float] = []
    failures = 0
    socket = dealer(endpoint, curve)
    try:
        while not stop.wait(every_s):
            began = time.monotonic()
            socket.send(encode(Health()))
            if socket.poll(timeout_s * 1000) and isinstance(decode(socket.recv()), Health):
                latencies_ms.append((time.monotonic() - began) * 1000)
            else:
                failures += 1
                socket.close(0)
                socket = dealer(endpoint, curve)
    finally:
        socket.close(0)
        results.send((latencies_ms, failures))


def dealer(endpoint: str, curve: ClientCurve | None = None, unbounded: bool = False) -> zmq.Socket:
    """A raw DEALER at ``endpoint`` (CURVE with ``curve``), dropped at once when closed;
    ``unbounded``: no high-water marks (a fuzzer that keeps hundreds of frames in flight)."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    if unbounded:
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
    if curve is not None:
        curve.apply(socket)
    socket.connect(endpoint)
    return socket


def resources_dict(before: ProcessResources, after: ProcessResources) -> dict:
    return {"before": asdict(before), "after": asdict(after),
            "rss_growth_mb": round(after.rss_mb - before.rss_mb, 1),
            "thread_growth": after.threads - before.threads, "fd_growth": after.fds - before.fds}
