"""The thread that owns a daemon's ROUTER socket: it reads every client message, answers what
needs no state at once, hands the rest to the daemon's loop, and sends the loop's replies.

Answered here, whatever the loop is doing (a long engine step, a grammar being checked): a
``health`` probe (from ``health()``), an undecodable message (the ``error`` ``incoming`` made of
it), a message from a CURVE key that has been removed since it connected. A sender past its
frame rate (``frames``: a bucket per CURVE key, else per connection) loses the frame unread:
answering a flood would double it. Senders in the daemon's own process (its HTTP front, which
carries every HTTP tenant's requests and bounds them itself) have no frame rate. Everything
else goes to ``deliver`` as an ``Inbound``.

Replies come from the loop's thread through ``send``: an unbounded ``inproc`` pair, so the loop
never blocks on the socket; this thread relays them to their clients.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from shared.protocol.codec import encode
from shared.protocol.messages import Error, ErrorCode, Health, Message
from shared.transport.curve import ServerCurve
from shared.transport.quota import RobotQuotas
from shared.transport.router import Undecodable, incoming, relay_replies, router_socket, send_nowait, thread_pipe

POLL_MS = 100  # how often the thread looks at its stop flag when nothing arrives


@dataclass(frozen=True)
class Inbound:
    """A decoded client message for the loop: ``user_id`` is the sender's CURVE key (z85), None
    on a connection without CURVE; ``size`` its frame's bytes."""

    identity: bytes
    user_id: str | None
    msg: Message
    size: int


class SocketFront:
    """Binds ``endpoints`` (``tcp://host:0`` takes a free port: ``endpoints`` then holds the
    bound one) on one ROUTER socket, with ``curve`` applied when given. ``start`` runs the
    thread; ``close`` stops it after relaying the loop's last replies, and closes the socket.
    ``max_prompt_ids``: longer token id lists are answered ``too_large`` as they are decoded."""

    def __init__(self, context: zmq.Context, endpoints: tuple[str, ...], curve: ServerCurve | None,
                 frames: RobotQuotas, health: Callable[[], str], deliver: Callable[[Inbound], None],
                 on_frame_dropped: Callable[[], None] = lambda: None, max_prompt_ids: int | None = None):
        self.curve = curve
        self._max_prompt_ids = max_prompt_ids
        self._frames = frames
        self._health = health
        self._deliver = deliver
        self._on_frame_dropped = on_frame_dropped
        self.socket = router_socket(context)
        if curve is not None:
            curve.apply(self.socket)
        self.endpoints = [self._bind(endpoint) for endpoint in endpoints]
        self._replies_in, self._replies_out = thread_pipe(context, f"front-replies-{id(self):x}")
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="front-socket", daemon=True)

    def _bind(self, endpoint: str) -> str:
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            host = endpoint.rsplit(":", 1)[0]
            return f"{host}:{self.socket.bind_to_random_port(host)}"
        self.socket.bind(endpoint)
        return endpoint

    def start(self) -> None:
        self._thread.start()

    def send(self, identity: bytes, msg: Message) -> None:
        """The loop's thread only: a reply for this thread to send."""
        self._replies_out.send_multipart([identity, encode(msg)])

    def close(self) -> None:
        """After ``start``: stop the thread (the replies sent before this call still go out); the
        thread closes the socket as it ends, whether it stopped or failed."""
        self._done.set()
        self._thread.join()
        self._replies_out.close()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._replies_in, zmq.POLLIN)
        try:
            while not self._done.is_set():
                events = dict(poller.poll(POLL_MS))
                if self._replies_in in events:
                    relay_replies(self._replies_in, self.socket)
                if self.socket in events:
                    self._triage()
            relay_replies(self._replies_in, self.socket)  # the loop's last words
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._replies_in.close()
        self.socket.close()
        if self.curve is not None:
            self.curve.stop()

    def _triage(self) -> None:
        for identity, user_id, in_process, payload, msg in incoming(self.socket, max_ids=self._max_prompt_ids):
            limited = self._frames.config.enabled and not in_process
            if limited and self._frames.charge(user_id or identity.hex(), 0) > 0:
                self._on_frame_dropped()
            elif user_id is not None and self.curve is not None and not self.curve.allows(user_id):
                self._reply(identity, Error(ErrorCode.UNAVAILABLE, "this client's CURVE key is no longer authorized",
                                            getattr(msg, "request_id", None)))
            elif isinstance(msg, Undecodable):
                self._reply(identity, msg.error)
            elif isinstance(msg, Health):
                self._reply(identity, Health(self._health()))
            else:
                self._deliver(Inbound(identity, user_id, msg, len(payload)))

    def _reply(self, identity: bytes, msg: Message) -> None:
        send_nowait(self.socket, identity, encode(msg))
