"""An HTTP API on a CloudServer in this process (a tiny random model, the default model's
tokenizer), and raw-socket helpers, for the HTTP tests."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cloudd.api_keys import ApiKeys
from cloudd.http_api import ApiContext, HttpLimits, HttpServer
from cloudd.server import CloudServer, ServeConfig
from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.transport.client import FleetClient
from shared.transport.loopback import free_port
from tests.engine.tiny import tiny_model
from tests.serving_thread import serving_thread


@dataclass(frozen=True)
class Served:
    url: str
    server: CloudServer
    client: FleetClient


@contextlib.contextmanager
def serve_http(tokenizer, api_keys: ApiKeys | None = None, limits: HttpLimits = HttpLimits(),
               **serve) -> Iterator[Served]:
    """An HTTP front end on a CloudServer (``ServeConfig(**serve)``) running in a thread."""
    model = tiny_model(vocab_size=tokenizer.vocab_size, tie_word_embeddings=False)
    engine = Engine(model, tokenizer, EngineConfig(block_size=16, num_blocks=256))
    server = CloudServer(engine, ServeConfig(zmq_port=0, http_port=0, **serve), "tiny")
    with (serving_thread(server),
          contextlib.closing(FleetClient(server.inproc_endpoint, context=server.context)) as client,
          serve_api(ApiContext(client, tokenizer, server.metrics, "tiny", api_keys), limits) as url):
        yield Served(url, server, client)


@contextlib.contextmanager
def serve_api(ctx: ApiContext, limits: HttpLimits = HttpLimits()) -> Iterator[str]:
    """The base URL of ``ctx``'s API served on loopback within ``limits``."""
    front = HttpServer.for_api("127.0.0.1", 0, ctx, limits)
    try:
        yield front.url
    finally:
        front.close()


def unused_endpoint() -> str:
    """A loopback ZeroMQ endpoint nobody listens on: a request sent there stays in flight."""
    return f"tcp://127.0.0.1:{free_port()}"


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def read_to_close(conn: socket.socket) -> bytes:
    received = b""
    while chunk := conn.recv(65536):
        received += chunk
    return received


def raw_http(url: str, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it."""
    with socket.create_connection(address(url), timeout=30) as conn:
        conn.sendall(data)
        return read_to_close(conn)


def post_head(length: str, path: str = "/v1/chat/completions", connection: str = "close") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\nConnection: {connection}\r\n\r\n").encode()


def wait_until(condition: Callable[[], object], within_s: float) -> None:
    """Return once ``condition()`` holds or ``within_s`` has passed (the caller asserts what it needs)."""
    deadline = time.monotonic() + within_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
