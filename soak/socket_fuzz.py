"""Fuzz a daemon's ZeroMQ socket: ``frames`` fuzz frames sent with at most ``window`` awaiting an
answer, every reply read and sorted, while a ``HealthWatch`` times the daemon's health answers.

A frame is *answered* when a final reply arrives (an ``error`` with its code, or the ``result``,
``stats`` or ``health`` a mutant that happened to be valid earns); it is *dropped* when no reply
comes within ``quiet_s`` of the last one (the transport drops a frame past its size limit, and
the daemon drops frames over a sender's rate). Replies cannot be matched to frames one by one (a
garbled frame has no request id), so the counts are totals: ``answered + dropped == frames``.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import zmq

from shared.protocol.codec import ProtocolError, decode
from shared.protocol.messages import Chunk, Error
from shared.transport.curve import ClientCurve
from soak.fuzz_frames import FrameSource
from soak.probes import dealer


@dataclass
class SocketFuzzCounts:
    frames: int = 0
    answered: int = 0
    dropped: int = 0
    by_family: Counter = field(default_factory=Counter)
    replies: Counter = field(default_factory=Counter)  # "error:<code>", "result", "stats", "health", "chunk"
    undecodable_replies: int = 0  # a reply that is not a protocol message: a daemon bug
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"frames": self.frames, "answered": self.answered, "dropped": self.dropped,
                "by_family": dict(self.by_family), "replies": dict(self.replies),
                "undecodable_replies": self.undecodable_replies, "seconds": round(self.seconds, 1),
                "frames_per_s": round(self.frames / self.seconds) if self.seconds else None}


def fuzz_socket(endpoint: str, source: FrameSource, frames: int, curve: ClientCurve | None = None,
                window: int = 512, quiet_s: float = 2.0, time_limit_s: float = 600.0) -> SocketFuzzCounts:
    """Send ``frames`` frames from ``source`` (fewer if ``time_limit_s`` runs out) and count."""
    counts = SocketFuzzCounts()
    socket = dealer(endpoint, curve, unbounded=True)
    outstanding = 0
    began = time.monotonic()
    last_reply = began
    try:
        while counts.frames < frames or outstanding:
            now = time.monotonic()
            if counts.frames < frames and outstanding < window and now - began < time_limit_s:
                frame = source.next()
                socket.send_multipart(frame.parts, copy=len(frame.parts[0]) < 65536)
                counts.frames += 1
                counts.by_family[frame.family] += 1
                outstanding += 1
                if outstanding < window:
                    outstanding -= _read_replies(socket, counts, 0)
                    continue
            got = _read_replies(socket, counts, 100)
            outstanding -= got
            if got:
                last_reply = time.monotonic()
            elif time.monotonic() - last_reply > quiet_s:  # the rest will not be answered
                counts.dropped += outstanding
                outstanding = 0
                last_reply = time.monotonic()
                if counts.frames >= frames or time.monotonic() - began >= time_limit_s:
                    break
    finally:
        socket.close(0)
        counts.seconds = time.monotonic() - began
    counts.answered = counts.frames - counts.dropped
    return counts


def _read_replies(socket: zmq.Socket, counts: SocketFuzzCounts, timeout_ms: int) -> int:
    """Read what has arrived (waiting up to ``timeout_ms`` for the first); returns the number of
    final replies among them."""
    finals = 0
    if not socket.poll(timeout_ms):
        return 0
    while True:
        try:
            payload = socket.recv(zmq.NOBLOCK)
        except zmq.Again:
            return finals
        try:
            reply = decode(payload)
        except ProtocolError:
            counts.undecodable_replies += 1
            finals += 1
            continue
        if isinstance(reply, Chunk):
            counts.replies["chunk"] += 1
            continue
        counts.replies[f"error:{reply.code.value}" if isinstance(reply, Error) else reply.TYPE] += 1
        finals += 1
