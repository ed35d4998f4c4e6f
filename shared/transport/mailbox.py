"""Work handed to a daemon's loop thread from other threads, with a file descriptor the loop
polls beside its sockets (``zmq.Poller`` accepts it), so a posted event wakes the loop at once."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable


class Mailbox:
    """Callables posted from any thread, run on the loop's thread by ``run``. ``fd`` is readable
    while events wait. Posting never blocks (the wake-up pipe holds at most one byte that
    matters; a full pipe already wakes the loop). After ``close`` a post is dropped: a worker
    that outlives the loop (a prepare still running at shutdown) never writes to a descriptor
    number the process has since given to another file."""

    def __init__(self) -> None:
        self._events: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._closing = threading.Lock()  # held by a wake-up's write and by close
        self._closed = False

    @property
    def fd(self) -> int:
        return self._read

    def post(self, event: Callable[[], None]) -> None:
        """Any thread: run ``event`` on the loop's thread."""
        self._events.put(event)
        self.wake()

    def wake(self) -> None:
        """Any thread: make the loop's poll return."""
        with self._closing:
            if self._closed:
                return
            try:
                os.write(self._write, b"x")
            except BlockingIOError:  # a wake-up is pending already
                pass

    def run(self, wait_s: float = 0.0, until: Callable[[], bool] = lambda: False, limit: int | None = None) -> None:
        """Loop thread: run the events waiting; with ``wait_s``, keep waiting for more that long,
        or until ``until()`` holds after an event. At most ``limit`` events (None: no limit): the
        rest wait for the next call, and ``fd`` stays readable for them (a flood of posts cannot
        keep the loop here)."""
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass
        ends = time.monotonic() + wait_s
        ran = 0
        while limit is None or ran < limit:
            try:
                left = ends - time.monotonic()
                event = self._events.get(timeout=left) if left > 0 else self._events.get_nowait()
            except queue.Empty:
                return
            event()
            ran += 1
            if until():
                ends = 0.0
        self.wake()

    def close(self) -> None:
        with self._closing:
            self._closed = True
            os.close(self._read)
            os.close(self._write)
