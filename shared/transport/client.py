"""The protocol client: one DEALER socket, many requests in flight, safe from any thread.

A background I/O thread owns the socket (ZeroMQ sockets are not thread-safe); callers hand it
messages through a queue and a wake-up pipe, and read replies from per-request ``Call`` queues.

Reliability (the Lazy Pirate pattern, plus heartbeats and resumption):

- While requests are in flight and the daemon has been silent for ``heartbeat_s``, the client
  sends a ``health`` probe; any reply proves the daemon alive.
- Silent for ``timeout_s``: the link is presumed dead. The client drops the socket, connects a
  fresh one and re-sends every unfinished ``generate`` with the same ``request_id`` and
  ``resume_from`` set to the next chunk it expects. The daemon's ledger makes that safe: a
  retry attaches to the running request or gets the finished result, and never runs it twice.
- After ``retries`` reconnections without hearing back, unfinished calls fail with an
  ``unavailable`` error.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator

import zmq
import zmq.utils.monitor

from shared.protocol.codec import ProtocolError, decode, encode
from shared.protocol.messages import Cancel, Chunk, Error, ErrorCode, Generate, Health, Message, Result, Stats
from shared.transport.curve import ClientCurve
from shared.transport.local_socket import expand_endpoint

log = logging.getLogger(__name__)

Reply = Chunk | Result | Error


class RequestFailed(Exception):
    """The daemon answered with an ``error`` (or the link gave up): ``code`` says which."""

    def __init__(self, error: Error):
        super().__init__(f"{error.code.value}: {error.message}")
        self.error = error
        self.code = error.code


class RequestInFlight(ValueError):
    """``start`` of a request id this client has in flight: its replies cannot go to two callers."""


class Call:
    """One request in flight: its replies arrive on ``events``; it ends with a result or error."""

    def __init__(self, request: Generate | None, request_id: str, notify: Callable[[], None] | None = None):
        """``notify``: called (on the client's I/O thread) after each reply is queued."""
        self.request = request
        self.request_id = request_id
        self.next_seq = request.resume_from if request is not None else 0
        self.done = threading.Event()
        self._queue: queue.Queue[Reply] = queue.Queue()
        self._notify = notify

    def _deliver(self, reply: Reply) -> bool:
        """Queue a reply unless it is a duplicate; True if it ended the call."""
        if self.done.is_set():
            return False
        if isinstance(reply, Chunk):
            if reply.seq != self.next_seq:
                return False  # a resent chunk we already have (or a gap we will get resent)
            self.next_seq += 1
        self._queue.put(reply)
        ended = isinstance(reply, Result | Error)
        if ended:
            self.done.set()
        if self._notify is not None:
            self._notify()
        return ended

    def events(self, timeout_s: float | None = None) -> Iterator[Reply]:
        """Chunks as they come, then the result or error. ``timeout_s`` bounds each wait; on
        expiry a ``TimeoutError`` is raised (the request keeps running; cancel it if unwanted)."""
        while True:
            try:
                reply = self._queue.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no reply for {self.request_id!r} within {timeout_s} s") from None
            yield reply
            if isinstance(reply, Result | Error):
                return

    def ready_replies(self) -> list[Reply]:
        """Every reply queued now, without waiting (a relay woken by ``notify`` forwards a
        step's replies together); it ends with the result or error once that has come."""
        replies: list[Reply] = []
        while not (replies and isinstance(replies[-1], Result | Error)):
            try:
                replies.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return replies

    def result(self, timeout_s: float | None = None) -> Result:
        """The final result; raises ``RequestFailed`` for an error reply."""
        for reply in self.events(timeout_s):
            if isinstance(reply, Error):
                raise RequestFailed(reply)
            if isinstance(reply, Result):
                return reply
        raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    timeout_s: float = 10.0  # daemon silent this long (probes unanswered): reconnect and retry
    heartbeat_s: float = 1.0  # probe a silent daemon this often while requests are in flight
    retries: int = 3  # reconnections before unfinished calls fail with "unavailable"
    curve: ClientCurve | None = None  # CURVE keys: encrypt, and authenticate to the daemon

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.heartbeat_s <= 0 or self.retries < 0:
            raise ValueError("timeout_s and heartbeat_s must be > 0, retries >= 0")


class FleetClient:
    """Talks the protocol to a daemon at ``endpoint`` (``tcp://127.0.0.1:5555``, ``ipc://...``,
    or ``inproc://...`` with the daemon's ``context``; ``ipc://~/...``: under this user's home).
    Close it when done (or use ``with``)."""

    def __init__(self, endpoint: str, config: ClientConfig = ClientConfig(), context: zmq.Context | None = None):
        self.endpoint = expand_endpoint(endpoint)
        self.config = config
        self._context = context or zmq.Context.instance()
        self._outbox: queue.Queue[bytes | None] = queue.Queue()  # encoded by the caller: the I/O thread only sends
        self._wake_r, self._wake_w = os.pipe()
        self._calls: dict[str, Call] = {}
        self._calls_lock = threading.Lock()
        self._control: queue.Queue[Message] = queue.Queue()  # stats/health replies
        self._control_lock = threading.Lock()
        self._ids = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"fleet-client {endpoint}", daemon=True)
        self._thread.start()

    # --- requests ---------------------------------------------------------------------------

    def start(self, request: Generate, notify: Callable[[], None] | None = None) -> Call:
        """Send ``request`` and return its call (``notify``: see ``Call``). Raises ValueError
        when the request cannot be encoded and ``RequestInFlight`` when this client has a call
        under its id in flight; either way nothing is sent."""
        payload = encode(request)
        with self._calls_lock:
            call = self._calls.get(request.request_id)
            if call is not None and not call.done.is_set():
                raise RequestInFlight(f"request_id {request.request_id!r} is already in flight on this client")
            call = Call(request, request.request_id, notify)
            self._calls[request.request_id] = call
        self._send_payload(payload)
        return call

    def generate(self, request: Generate, timeout_s: float | None = None) -> Result:
        return self.start(request).result(timeout_s)

    def stream(self, request: Generate, timeout_s: float | None = None) -> Iterator[Reply]:
        return self.start(dataclasses.replace(request, stream=True)).events(timeout_s)

    def cancel(self, request_id: str, timeout_s: float | None = None) -> Result:
        """Stop a request; returns its final result (finish reason ``abort``, or how it had
        already ended). Raises ``RequestFailed`` (``not_found``) for an unknown id."""
        with self._calls_lock:
            call = self._calls.get(request_id)
            if call is None or call.done.is_set():
                call = Call(None, request_id)
                self._calls[request_id] = call
        self._send(Cancel(request_id))
        return call.result(timeout_s if timeout_s is not None else self.config.timeout_s)

    def cancel_nowait(self, request_id: str) -> None:
        """Ask the daemon to stop a request this client started, without waiting: the
        request's own call then ends with its result (finish reason ``abort``)."""
        self._send(Cancel(request_id))

    def stats(self, timeout_s: float | None = None) -> dict:
        reply = self._ask(Stats(), timeout_s)
        if isinstance(reply, Error):
            raise RequestFailed(reply)
        return reply.values or {}

    def health(self, timeout_s: float | None = None) -> str:
        reply = self._ask(Health(), timeout_s)
        if isinstance(reply, Error):
            raise RequestFailed(reply)
        return reply.status or ""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._outbox.put(None)
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals --------------------------------------------------------------------------

    def _ask(self, msg: Stats | Health, timeout_s: float | None) -> Message:
        """One control query at a time; stale replies (heartbeats) are skipped by type."""
        timeout = timeout_s if timeout_s is not None else self.config.timeout_s
        with self._control_lock:
            while not self._control.empty():
                self._control.get_nowait()
            self._send(msg)
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                try:
                    reply = self._control.get(timeout=left)
                except queue.Empty:
                    break
                if isinstance(reply, type(msg) | Error):
                    return reply
            raise TimeoutError(f"no {msg.TYPE} reply from {self.endpoint} within {timeout} s")

    def _send(self, msg: Message) -> None:
        self._send_payload(encode(msg))

    def _send_payload(self, payload: bytes) -> None:
        if self._closed:
            raise RuntimeError("client is closed")
        self._outbox.put(payload)
        os.write(self._wake_w, b"x")

    def _connect(self) -> tuple[zmq.Socket, zmq.Socket]:
        """A new DEALER to the daemon and a monitor socket reporting failed CURVE handshakes."""
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.config.curve is not None:
            self.config.curve.apply(sock)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                          | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(self.endpoint)
        return sock, monitor

    @staticmethod
    def _handshake_news(monitor: zmq.Socket, refused: bool) -> bool:
        """Whether the daemon refuses our key, after the monitor's queued events (the latest
        handshake decides; ``refused`` when there is no news)."""
        while monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
            refused = event != zmq.EVENT_HANDSHAKE_SUCCEEDED
        return refused

    def _run(self) -> None:
        sock, monitor = self._connect()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        last_heard = last_probe = time.monotonic()
        failures = 0
        unsent: collections.deque[bytes] = collections.deque()
        refused = False  # the daemon refused our key: until it answers, every call fails at once
        try:
            while True:
                events = dict(poller.poll(timeout=self.config.heartbeat_s * 1000 / 4))
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                while True:  # take everything queued
                    try:
                        payload = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    if payload is None:
                        return
                    unsent.append(payload)
                if monitor in events:  # NOTE: sticky: the refusal may come before any call is in flight
                    refused = self._handshake_news(monitor, refused)
                if refused and self._in_flight():
                    unsent.clear()
                    self._fail_all(f"{self.endpoint} refused this client's CURVE key (authentication failed)")
                _send_ready(sock, unsent)
                if sock in events:
                    while sock.poll(0):
                        self._dispatch(sock.recv())
                    last_heard = time.monotonic()
                    failures = 0
                now = time.monotonic()
                if not self._in_flight():
                    last_heard = now
                    continue
                if now - last_heard >= self.config.timeout_s:
                    failures += 1
                    if failures > self.config.retries:
                        self._fail_all(f"no reply from {self.endpoint} after {self.config.retries} retries")
                        failures, last_heard = 0, now
                        continue
                    log.warning("daemon at %s silent for %.1f s: reconnecting (retry %d)", self.endpoint,
                                now - last_heard, failures)
                    for old in (sock, monitor):
                        poller.unregister(old)
                    sock.disable_monitor()
                    monitor.close()
                    sock.close()
                    sock, monitor = self._connect()
                    poller.register(sock, zmq.POLLIN)
                    poller.register(monitor, zmq.POLLIN)
                    unsent.clear()  # what the old socket did not send is re-sent below, as of now
                    for call in self._in_flight():
                        if call.request is not None:
                            unsent.append(encode(dataclasses.replace(call.request, resume_from=call.next_seq)))
                        else:
                            unsent.append(encode(Cancel(call.request_id)))
                    _send_ready(sock, unsent)
                    last_heard = last_probe = now
                elif now - last_heard >= self.config.heartbeat_s and now - last_probe >= self.config.heartbeat_s:
                    unsent.append(encode(Health()))
                    _send_ready(sock, unsent)
                    last_probe = now
        finally:
            sock.disable_monitor()
            monitor.close()
            sock.close()

    def _in_flight(self) -> list[Call]:
        with self._calls_lock:
            return [c for c in self._calls.values() if not c.done.is_set()]

    def _dispatch(self, data: bytes) -> None:
        try:
            msg = decode(data)
        except ProtocolError as e:
            log.error("undecodable reply from %s: %s", self.endpoint, e.message)
            return
        request_id = getattr(msg, "request_id", None)
        if isinstance(msg, Chunk | Result | Error) and request_id is not None:
            with self._calls_lock:
                call = self._calls.get(request_id)
                if call is not None and call._deliver(msg):
                    del self._calls[request_id]
            return
        self._control.put(msg)

    def _fail_all(self, message: str) -> None:
        for call in self._in_flight():
            call._deliver(Error(ErrorCode.UNAVAILABLE, message, call.request_id))
        with self._calls_lock:
            for rid in [rid for rid, c in self._calls.items() if c.done.is_set()]:
                del self._calls[rid]


def _send_ready(sock: zmq.Socket, unsent: collections.deque) -> None:
    """Send queued messages in order without blocking: a DEALER with no connected peer (still
    connecting, or refused) would block the I/O thread; what cannot go now waits for the next turn."""
    while unsent:
        try:
            sock.send(unsent[0], zmq.NOBLOCK)
        except zmq.Again:
            return
        unsent.popleft()
