"""Fuzz cloudd's OpenAI HTTP API over raw sockets: malformed requests, slow and half-sent ones,
and a crowd of idle connections.

Every malformed request must get a status line (4xx, or 503 when the request slots are full)
and never a 500; a slow or half-sent request must be closed by the server's timeout (or
answered), and the idle crowd must not keep the server from answering the next client once it
has been closed.
"""

from __future__ import annotations

import json
import random
import socket
import time
from collections import Counter
from dataclasses import dataclass, field

_BODY_OK = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def _request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
             token: str | None = None) -> bytes:
    head = {"Host": "127.0.0.1", "Content-Length": str(len(body)), "Content-Type": "application/json"}
    if token is not None:
        head["Authorization"] = f"Bearer {token}"
    head.update(headers or {})
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
    return f"{method} {path} HTTP/1.1\r\n{lines}\r\n".encode() + body


def malformed_requests(token: str, rng: random.Random) -> list[tuple[str, bytes]]:
    """One of each kind of bad request, named (most with a valid token: the parsers behind the door)."""
    chat = "/v1/chat/completions"
    deep = ("[" * 100_000 + "]" * 100_000).encode()
    mutants = (
        ("max_tokens", 2**64), ("max_tokens", -1), ("temperature", "hot"), ("seed", 2**70), ("top_k", 1e400),
        ("messages", "hi"), ("messages", [{"role": 1}]), ("response_format", {"type": "regex", "regex": "((a*)*)*b"}),
        ("n", 5), ("stop", ["s"] * 1_000), ("stream", "yes"), ("deadline_ms", 2**63), ("request_id", "x" * 10_000))
    return [
        ("bad json", _request("POST", chat, b"{not json", token=token)),
        ("json list", _request("POST", chat, b"[]", token=token)),
        ("deep json", _request("POST", chat, deep, token=token)),
        ("no token", _request("POST", chat, json.dumps(_BODY_OK).encode(), token=None)),
        ("wrong token", _request("POST", chat, json.dumps(_BODY_OK).encode(), token="wrong")),
        ("2 MiB body", _request("POST", chat, b"x" * (2 << 20), token=token)),
        ("length -1", _request("POST", chat, b"{}", {"Content-Length": "-1"}, token=token)),
        ("length ten", _request("POST", chat, b"{}", {"Content-Length": "ten"}, token=token)),
        ("length 1e20", _request("POST", chat, b"{}", {"Content-Length": "99999999999999999999"}, token=token)),
        ("unknown path", _request("POST", "/v1/nothing", b"{}", token=token)),
        ("DELETE", _request("DELETE", chat, b"", token=token)),
        ("70 KB path", _request("GET", "/" + "a" * 70_000, token=token)),
        ("garbage line", b"GARBAGE\r\n\r\n"),
        ("HTTP/9.9", b"GET / HTTP/9.9\r\n\r\n"),
        ("500 headers", b"POST /v1/chat/completions HTTP/1.1\r\n" + b"X-A: b\r\n" * 500 + b"\r\n"),
        ("header without colon", b"POST /v1/chat/completions HTTP/1.1\r\nNoColonHere\r\n\r\n"),
        # ended as a head ends: a server rightly waits out its head deadline for an unended one
        # (the half-sent requests below), which would make each of these cost http_timeout_s
        ("random bytes", rng.randbytes(512) + b"\r\n\r\n"),
        *((f"body {key}={str(value)[:20]}", _request("POST", chat, json.dumps(dict(_BODY_OK, **{key: value})).encode(),
                                                     token=token)) for key, value in mutants),
    ]


@dataclass
class HttpFuzzCounts:
    requests: int = 0
    # "400", "413", ..., or "closed": no status line (closed, or answered the HTTP/0.9 way, as the
    # standard library answers a request line it cannot parse)
    statuses: Counter = field(default_factory=Counter)
    by_kind: dict = field(default_factory=dict)  # each kind's answers: {"bad json": {"400": 12}, ...}
    server_errors: int = 0  # 500s: a handler raised
    slow_closed_by_server: int = 0
    slow_sent: int = 0
    idle_opened: int = 0
    answered_after_idle: bool = False
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"requests": self.requests, "statuses": dict(self.statuses), "by_kind": self.by_kind,
                "server_errors": self.server_errors,
                "slow_sent": self.slow_sent, "slow_closed_by_server": self.slow_closed_by_server,
                "idle_connections": self.idle_opened, "answered_after_idle": self.answered_after_idle,
                "seconds": round(self.seconds, 1)}


def fuzz_http(port: int, token: str, requests: int, seed: int, timeout_s: float, idle: int = 300,
              slow: int = 50) -> HttpFuzzCounts:
    """``requests`` malformed requests, then ``slow`` half-sent ones held past the server's
    ``timeout_s``, then ``idle`` silent connections at once, then one good ``/v1/models``."""
    rng = random.Random(seed)
    counts = HttpFuzzCounts()
    began = time.monotonic()
    kinds = malformed_requests(token, rng)
    for i in range(requests):
        kind, payload = kinds[i % len(kinds)]
        status = exchange(port, payload)
        counts.requests += 1
        counts.statuses[status] += 1
        counts.by_kind.setdefault(kind, Counter())[status] += 1
        counts.server_errors += status == "500"
    half = [_open(port) for _ in range(slow)]
    for conn in half:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"mo")
        counts.slow_sent += 1
    crowd = [_open(port) for _ in range(idle)]
    counts.idle_opened = len(crowd)
    time.sleep(timeout_s + 2.0)  # past the server's timeout: it must have let go of all of them
    counts.slow_closed_by_server = sum(_let_go(conn) for conn in half)
    for conn in half + crowd:
        conn.close()
    counts.answered_after_idle = exchange(port, _request("GET", "/v1/models", token=token)) == "200"
    counts.seconds = time.monotonic() - began
    return counts


def _let_go(conn: socket.socket) -> bool:
    """Whether the server closed (or answered) this connection: a read does not wait."""
    conn.settimeout(0.5)
    try:
        conn.recv(65536)  # b"" (closed) or an error answer
    except TimeoutError:
        return False  # still held open
    except OSError:
        pass  # reset: let go too
    return True


def _open(port: int, timeout_s: float = 10.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout_s)


def exchange(port: int, payload: bytes, timeout_s: float = 10.0) -> str:
    """Send ``payload`` on a fresh connection; the status code, or "closed" with no status line
    (none within ``timeout_s`` included). OSError if the connection cannot be opened."""
    with _open(port, timeout_s) as conn:
        try:
            # NOTE: no half-close after it: the server takes a closed read side as the client gone
            conn.sendall(payload)
        except OSError:
            pass  # the server may close on us mid-send (an oversize body): its answer is still readable
        try:
            line = conn.makefile("rb").readline(200)
        except OSError:
            return "closed"
    parts = line.split()
    return parts[1].decode() if len(parts) >= 2 and line.startswith(b"HTTP/") else "closed"
