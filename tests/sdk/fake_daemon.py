"""A scripted fleet daemon for SDK tests: a real ZeroMQ ROUTER on loopback, speaking the real
codec, whose answers to ``generate`` a test writes (edged's ``source=edge`` and ``degraded``
answers before edged exists, silence, errors, chunked streams)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq

from shared.protocol.codec import decode, encode
from shared.protocol.messages import Cancel, Chunk, Error, ErrorCode, Generate, Health, Message, Result, Usage

Script = Callable[[Generate, int], list[Message] | None]  # (request, attempt) -> replies; None: silent


def result(request: Generate, text: str, **fields) -> Result:
    return Result(request.request_id, text, fields.pop("finish_reason", "stop"), Usage(10, 5), **fields)


def chunks(request: Generate, text: str, sizes: list[int]) -> list[Chunk]:
    """``text`` cut into chunks of ``sizes`` characters (the rest in a last chunk)."""
    out, pos = [], 0
    for size in [*sizes, len(text)]:
        if pos >= len(text):
            break
        out.append(Chunk(request.request_id, len(out), (), text[pos: pos + size]))
        pos += size
    return out


class FakeDaemon:
    """Answers ``generate`` with ``script``, ``health`` with "ok", ``cancel`` of a request it
    holds with an ``abort`` result, and of any other with ``not_found``. Records everything it
    received, also while ``mute`` (never answers) or from a first peer it was told to drop."""

    def __init__(self, script: Script, mute: bool = False, drop_first_peer: bool = False):
        self.script = script
        self.mute = mute  # answers nothing at all: a dead daemon
        self.drop_first_peer = drop_first_peer  # the first client socket's link is dead (both ways)
        self._first_peer: bytes | None = None
        self.received: list[Message] = []
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._held: dict[str, bytes] = {}  # silent requests: id -> who asked
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def generates(self) -> list[Generate]:
        return [m for m in self.received if isinstance(m, Generate)]

    def cancels(self) -> list[str]:
        return [m.request_id for m in self.received if isinstance(m, Cancel)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def __enter__(self) -> FakeDaemon:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self) -> None:
        attempts: dict[str, int] = {}
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            identity, data = self._sock.recv_multipart()
            msg = decode(data)
            self.received.append(msg)
            self._first_peer = self._first_peer or identity
            if self.mute or (self.drop_first_peer and identity == self._first_peer):
                continue
            if isinstance(msg, Health):
                self._sock.send_multipart([identity, encode(Health("ok"))])
            elif isinstance(msg, Cancel):
                self._cancel(identity, msg.request_id)
            elif isinstance(msg, Generate):
                attempt = attempts[msg.request_id] = attempts.get(msg.request_id, -1) + 1
                replies = self.script(msg, attempt)
                if replies is None:
                    self._held[msg.request_id] = identity
                for reply in replies or ():
                    self._sock.send_multipart([identity, encode(reply)])

    def _cancel(self, identity: bytes, request_id: str) -> None:
        asker = self._held.pop(request_id, None)
        if asker is None:
            error = Error(ErrorCode.NOT_FOUND, f"no request {request_id!r}", request_id)
            self._sock.send_multipart([identity, encode(error)])
            return
        aborted = Result(request_id, "", "abort", Usage(10, 0))
        for who in {asker, identity}:
            self._sock.send_multipart([who, encode(aborted)])
