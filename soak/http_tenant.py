"""An HTTP tenant beside an HTTP attack: ``GET /v1/models`` with its API key every ``every_s``
from its own thread; every answer that is not 200 (a 503 from a full connection cap, a closed
connection, no answer within ``timeout_s``) counts as refused."""

from __future__ import annotations

import socket
import threading
from collections import Counter


class HttpTenant:
    def __init__(self, port: int, api_key: str, every_s: float = 0.5, timeout_s: float = 5.0):
        self.port, self.api_key, self.every_s, self.timeout_s = port, api_key, every_s, timeout_s
        self.statuses: Counter = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="http-tenant", daemon=True)

    @property
    def refused(self) -> int:
        return sum(n for status, n in self.statuses.items() if status != "200")

    def __enter__(self) -> HttpTenant:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + 5)

    def _run(self) -> None:
        request = (f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {self.api_key}\r\n"
                   "Connection: close\r\n\r\n").encode()
        while not self._stop.wait(self.every_s):
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=self.timeout_s) as conn:
                    conn.sendall(request)
                    line = conn.makefile("rb").readline(200)
                parts = line.split()
                self.statuses[parts[1].decode() if line.startswith(b"HTTP/") and len(parts) > 1 else "closed"] += 1
            except OSError:
                self.statuses["no answer"] += 1
