"""The server side of a ROUTER socket, shared by cloudd and edged: read what waits, send
without ever blocking the daemon's loop."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import zmq

from shared.protocol.codec import MAX_MESSAGE_BYTES, ProtocolError, decode
from shared.protocol.messages import Error, ErrorCode, Message

log = logging.getLogger(__name__)

# ZeroMQ drops a frame past this before reading it whole (and disconnects its sender); up to it an
# oversize message is read and answered ``too_large`` by ``decode``. Without it a 1 GiB frame was
# received whole (+1.2 GB peak) before that reply.
MAX_FRAME_BYTES = 8 * MAX_MESSAGE_BYTES


def router_socket(context: zmq.Context) -> zmq.Socket:
    """A daemon's ROUTER socket: frames bounded by ``MAX_FRAME_BYTES``; on close, up to a second
    to let the last replies out."""
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 1000)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    return socket


# Messages read per turn of a daemon's socket loop. A health probe that arrives during a turn waits
# for the turn: under a flood, turns of 1000 frames held probes for 100-300 ms.
READ_BATCH = 64


@dataclass(frozen=True)
class Undecodable:
    """A frame that did not decode as a message: ``error`` is the answer it gets. A type of its
    own, since an ``error`` message a peer sends decodes to an ``Error`` and is a request to
    refuse like any other reply type, not an answer to send back."""

    error: Error

    @property
    def request_id(self) -> str | None:
        return self.error.request_id


def incoming(socket: zmq.Socket, limit: int = READ_BATCH,
             max_ids: int | None = None) -> Iterator[tuple[bytes, str | None, bool, bytes, Message | Undecodable]]:
    """Up to ``limit`` waiting messages as ``(identity, user_id, in_process, payload, message)``:
    ``user_id`` is the sender's CURVE key (z85) where the connection authenticated, else None;
    ``in_process``: the sender is in this process (``inproc``: the daemon's own HTTP front). A message
    that does not decode (or has extra frames, or a list past ``max_ids``: see ``decode``) comes
    as ``Undecodable``."""
    for _ in range(limit):
        try:
            frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        identity, payload = frames[0].bytes, frames[-1].bytes
        user_id, in_process = _user_id(frames[-1]), _in_process(frames[-1])
        try:
            if len(frames) != 2:
                raise ProtocolError(ErrorCode.BAD_MESSAGE, f"expected one frame per message, got {len(frames) - 1}")
            yield identity, user_id, in_process, payload, decode(payload, max_ids=max_ids)
        except ProtocolError as e:
            yield identity, user_id, in_process, payload, Undecodable(Error(e.code, e.message, e.request_id))


def _user_id(frame: zmq.Frame) -> str | None:
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:  # no authentication on this connection (plain TCP, inproc)
        return None


def _in_process(frame: zmq.Frame) -> bool:
    try:
        frame.get("Peer-Address")  # tcp and ipc peers have one; inproc peers none
    except zmq.ZMQError:
        return True
    return False


def send_nowait(socket: zmq.Socket, identity: bytes, payload: bytes) -> None:
    """Send one reply; a peer whose queue is full (gone or stuck) loses it -- a retry resends."""
    try:
        socket.send_multipart([identity, payload], zmq.NOBLOCK)
    except zmq.Again:
        log.warning("dropped a reply to a peer that does not read")


def thread_pipe(context: zmq.Context, name: str) -> tuple[zmq.Socket, zmq.Socket]:
    """Two connected PAIR sockets over ``inproc`` (the first bound, the second connected),
    unbounded so that neither of the two threads using them ever blocks on the other: how a
    daemon's worker thread hands replies to the thread that owns its ROUTER socket."""
    first, second = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    for sock in (first, second):
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
    first.bind(f"inproc://{name}")
    second.connect(f"inproc://{name}")
    return first, second


def relay_replies(pipe: zmq.Socket, socket: zmq.Socket) -> None:
    """Send every ``[identity, payload]`` waiting on ``pipe`` out of the ROUTER ``socket``."""
    while True:
        try:
            identity, payload = pipe.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        send_nowait(socket, identity, payload)
