"""A daemon's loop on a thread for a test: ``serving_thread(server)`` runs
``server.serve_forever`` (a ``RequestFront`` or a lane that has one: ``CloudServer``,
``EdgeServer``) until the block ends, then stops it (it drains) and joins the thread, which must
have ended."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


class Serving(Protocol):
    def serve_forever(self) -> None: ...

    def stop(self) -> None: ...


@contextmanager
def serving_thread(server: Serving, join_timeout_s: float = 30.0) -> Iterator[None]:
    thread = threading.Thread(target=server.serve_forever, name=f"{type(server).__name__}-under-test", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.stop()
        thread.join(timeout=join_timeout_s)
    assert not thread.is_alive(), f"{type(server).__name__} did not stop within {join_timeout_s} s"
