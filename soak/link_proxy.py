"""A TCP proxy on loopback that the soak harness puts between edged and cloudd, to cut, black-hole
and slow the robot's link on command.

Modes (``LinkProxy.set_mode``):

- ``PASS``: bytes flow both ways.
- ``DROP``: every open connection is closed (RST-free close) and new ones are accepted and closed
  at once: a link that is down.
- ``BLACKHOLE``: connections stay open and new ones are accepted, but every byte in either
  direction is read and discarded: a link that silently loses everything (what a dead NAT or
  radio looks like to TCP).
- ``DELAY``: bytes flow after ``delay_s`` each way, in order.

It listens only on 127.0.0.1 and connects only to a loopback target. One asyncio loop in a
daemon thread carries every connection.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time

from shared.transport.loopback import is_loopback


class LinkMode(enum.Enum):
    PASS = "pass"
    DROP = "drop"
    BLACKHOLE = "blackhole"
    DELAY = "delay"


class LinkProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1"):
        if not is_loopback(target_host):
            raise ValueError(f"the link proxy forwards to loopback only, not {target_host!r}")
        self.target = (target_host, target_port)
        self.mode = LinkMode.PASS
        self.delay_s = 0.0
        self.connections = 0  # accepted so far, in every mode
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link-proxy", daemon=True)
        self.port = 0

    def start(self) -> int:
        """Listen on a free loopback port; returns it."""
        self._thread.start()
        self._ready.wait(10)
        return self.port

    def set_mode(self, mode: LinkMode, delay_s: float = 0.0) -> None:
        """Switch the link (from any thread); ``DROP`` closes what is open now."""
        if delay_s < 0:
            raise ValueError("delay_s must be >= 0")
        done = threading.Event()

        def apply() -> None:
            self.mode, self.delay_s = mode, delay_s
            if mode is LinkMode.DROP:
                for writer in list(self._writers):
                    writer.close()
            done.set()

        self._loop.call_soon_threadsafe(apply)
        done.wait(10)

    def close(self) -> None:
        """Close every connection and stop the loop's thread."""
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _shutdown(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- the loop's side ---------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            self._loop.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.mode is LinkMode.DROP:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction; the link's mode is read per chunk of bytes."""
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        sender = asyncio.ensure_future(self._send_when_due(queue, writer))
        try:
            while data := await reader.read(65536):
                if self.mode is LinkMode.DROP:
                    break
                if self.mode is LinkMode.BLACKHOLE:
                    continue
                due = time.monotonic() + (self.delay_s if self.mode is LinkMode.DELAY else 0.0)
                queue.put_nowait((due, data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait(None)
            await sender
            writer.close()

    async def _send_when_due(self, queue: asyncio.Queue, writer: asyncio.StreamWriter) -> None:
        while (item := await queue.get()) is not None:
            due, data = item
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            if self.mode in (LinkMode.DROP, LinkMode.BLACKHOLE) or writer.is_closing():
                continue
            try:
                writer.write(data)
                await writer.drain()
            except (ConnectionError, OSError):
                return
