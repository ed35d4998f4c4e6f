"""The soak's link proxy: bytes pass, wait, vanish or the link drops, as commanded."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from soak.link_proxy import LinkMode, LinkProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def proxy() -> Iterator[LinkProxy]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    link = LinkProxy(server.server_address[1])
    link.start()
    yield link
    link.close()
    server.shutdown()


def _connect(link: LinkProxy) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", link.port), timeout=5)
    return conn


def _read(conn: socket.socket, n: int, timeout_s: float = 5.0) -> bytes:
    conn.settimeout(timeout_s)
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def test_bytes_pass_both_ways_in_order(proxy):
    with _connect(proxy) as conn:
        payload = bytes(range(256)) * 400
        conn.sendall(payload)
        assert _read(conn, len(payload)) == payload


def test_a_delayed_link_delivers_everything_late_but_in_order(proxy):
    proxy.set_mode(LinkMode.DELAY, delay_s=0.2)
    with _connect(proxy) as conn:
        began = time.monotonic()
        for i in range(5):
            conn.sendall(b"%d," % i)
        assert _read(conn, 10) == b"0,1,2,3,4,"
        assert time.monotonic() - began >= 0.4  # 0.2 s out and 0.2 s back, at least


def test_a_black_hole_swallows_bytes_and_the_link_comes_back(proxy):
    with _connect(proxy) as conn:
        proxy.set_mode(LinkMode.BLACKHOLE)
        conn.sendall(b"lost")
        with pytest.raises(TimeoutError):
            _read(conn, 4, timeout_s=0.5)
        proxy.set_mode(LinkMode.PASS)
        conn.sendall(b"back")
        assert _read(conn, 4) == b"back"  # the swallowed bytes never arrive


def test_a_dropped_link_closes_open_connections_and_refuses_new_ones_until_restored(proxy):
    conn = _connect(proxy)
    conn.sendall(b"x")
    assert _read(conn, 1) == b"x"
    proxy.set_mode(LinkMode.DROP)
    assert _read(conn, 1) == b""  # closed by the proxy
    conn.close()
    with _connect(proxy) as again:
        assert _read(again, 1) == b""
    proxy.set_mode(LinkMode.PASS)
    with _connect(proxy) as fresh:
        fresh.sendall(b"y")
        assert _read(fresh, 1) == b"y"


def test_only_a_loopback_target_is_accepted():
    with pytest.raises(ValueError, match="loopback"):
        LinkProxy(80, target_host="10.0.0.1")
