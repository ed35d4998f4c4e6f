"""cloudd's HTTP server at the connection level (issue 48 item 7), over raw sockets: slow heads
take no request slot and end at their deadline, framing is strict (a duplicate Content-Length,
a chunked body), and each bad or aborted connection logs one line and no traceback."""

from __future__ import annotations

import json
import logging
import socket
import struct
import time
from collections.abc import Iterator

import pytest

from cloudd.http_api import HttpLimits
from tests.cloudd.http_serving import Served, address, post_head, raw_http, serve_http, wait_until

CHAT = {"messages": [{"role": "user", "content": "Bring crate 17 to the dock."}], "max_tokens": 2,
        "temperature": 0, "ignore_eos": True}
MODELS = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
SETTLE_S = 60.0  # the most a test waits for something that must happen (no timing is asserted)


@pytest.fixture(scope="module")
def http(tokenizer) -> Iterator[Served]:
    """Two request slots, a 1 s head deadline."""
    with serve_http(tokenizer, limits=HttpLimits(timeout_s=1.0, max_requests=2)) as served:
        yield served


def chat_request(body: dict, extra_headers: str = "") -> bytes:
    data = json.dumps(body).encode()
    return post_head(str(len(data))).replace(b"\r\n\r\n", f"\r\n{extra_headers}\r\n".encode()
                                               if extra_headers else b"\r\n\r\n") + data


def test_slow_request_heads_take_no_request_slot(http):
    """Found in review: 256 connections sending a header byte every 10 s made every request 503
    for 30-50 s (a slot was taken per connection, before its head and its key)."""
    slow = [socket.create_connection(address(http.url), timeout=30) for _ in range(20)]
    try:
        for conn in slow:  # ten times the slots, each head unfinished
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Pad: a")
        assert raw_http(http.url, MODELS).startswith(b"HTTP/1.1 200")
        reply = raw_http(http.url, chat_request(CHAT))
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    finally:
        for conn in slow:
            conn.close()


def test_a_head_trickled_a_byte_at_a_time_is_closed_unanswered_at_its_deadline(http):
    """Each byte reset the old per-read timeout, so a trickled head held its connection for ever."""
    with socket.create_connection(address(http.url), timeout=30) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        conn.settimeout(0.05)
        received = None
        for _ in range(1_200):  # a byte every 50 ms: a minute of trickle, far past the 1 s deadline
            try:
                conn.sendall(b"a")
                received = conn.recv(1024)
                break  # the server closed (b"") or answered
            except TimeoutError:
                continue
            except OSError:  # reset by the close
                received = b""
                break
    assert received == b""


def test_duplicate_differing_content_lengths_are_a_400_and_no_second_request(http):
    """Found in review: the first Content-Length was used and the rest parsed as a next request."""
    hidden = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    body = json.dumps(CHAT).encode()
    head = post_head(str(len(body)), connection="keep-alive").replace(b"\r\n\r\n", b"\r\nContent-Length: 2\r\n\r\n")
    reply = raw_http(http.url, head + body + hidden)
    assert reply.startswith(b"HTTP/1.1 400") and reply.count(b"HTTP/1.1 ") == 1
    assert b"Content-Length" in reply


@pytest.mark.parametrize("header_bytes", [17_000, 100_000])
def test_a_head_past_16_kib_is_a_431_even_sent_in_one_write(http, header_bytes):
    """Found by fuzzing cloudd serve: h11 bounds only a head still arriving, so one sent whole passed."""
    reply = raw_http(http.url, chat_request(CHAT, f"X-Padding: {'p' * header_bytes}\r\n"))
    assert reply.startswith(b"HTTP/1.1 431") and b"exceeds 16384" in reply
    assert raw_http(http.url, MODELS).startswith(b"HTTP/1.1 200")  # and the server serves on
    assert raw_http(http.url, chat_request(CHAT, f"X-Padding: {'p' * 8_000}\r\n")).startswith(b"HTTP/1.1 200")


def test_a_chunked_body_is_read_as_the_body_of_one_request(http):
    """Found in review: with no Content-Length the body was taken as empty and the chunks parsed
    as a second request."""
    body = json.dumps(CHAT).encode()
    chunked = b"".join(f"{len(part):x}\r\n".encode() + part + b"\r\n" for part in (body[:10], body[10:])) + b"0\r\n\r\n"
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    reply = raw_http(http.url, head + chunked)
    assert reply.startswith(b"HTTP/1.1 200") and reply.count(b"HTTP/1.1 ") == 1
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["usage"]["completion_tokens"] == 2


def _reset(conn: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a crashed client does."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def _malformed(http: Served) -> None:
    raw_http(http.url, post_head("2").replace(b"\r\n\r\n", b"\r\nContent-Length: 7\r\n\r\n") + b"{}")


def _reset_mid_body(http: Served) -> None:
    conn = socket.create_connection(address(http.url), timeout=30)
    conn.sendall(post_head("100") + b'{"messages": [')
    time.sleep(0.2)  # NOTE: the head is read before the reset (else it is just a refused connection)
    _reset(conn)


def _left_mid_stream(http: Served) -> None:
    body = {**CHAT, "max_tokens": 400, "stream": True, "request_id": "leaves"}
    conn = socket.create_connection(address(http.url), timeout=30)
    conn.sendall(chat_request(body))
    assert conn.recv(65536).startswith(b"HTTP/1.1 200")
    _reset(conn)


@pytest.mark.parametrize("bad", [_malformed, _reset_mid_body, _left_mid_stream],
                         ids=["malformed", "reset-mid-body", "left-mid-stream"])
def test_a_bad_or_aborted_connection_logs_one_line_and_no_traceback(http, bad, caplog, capfd):
    """Found in review: every aborted connection logged a 20-line traceback."""
    with caplog.at_level(logging.INFO):
        bad(http)
        lines = _http_lines(caplog, wait_for=1)
        if bad is _left_mid_stream:  # its cancel has gone through: nothing more is coming
            wait_until(lambda: any(r["request_id"].endswith("leaves") for r in http.server.snapshot()["recent"]),
                       SETTLE_S)
        assert raw_http(http.url, MODELS).startswith(b"HTTP/1.1 200")
        lines = _http_lines(caplog)
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert all(r.exc_info is None for r in caplog.records)
    assert "Traceback" not in capfd.readouterr().err


def _http_lines(caplog, wait_for: int = 0) -> list[logging.LogRecord]:
    """The HTTP server's log records (cloudd's HTTP modules and uvicorn's)."""
    def lines():
        return [r for r in caplog.records if r.name.startswith(("cloudd.http_api", "uvicorn")) and r.levelno >= logging.INFO]
    wait_until(lambda: len(lines()) >= wait_for, SETTLE_S)
    return lines()


