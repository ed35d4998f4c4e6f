"""An HTTP tenant beside an HTTP attack: ``GET /v1/models`` with its API key every ``every_s``
from its own thread; every answer that is not 200 (a 503 from full request slots, a closed
connection, no answer within ``timeout_s``) counts as refused."""

from __future__ import annotations

import threading
from collections import Counter

from soak.http_fuzz import exchange


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
                self.statuses[exchange(self.port, request, self.timeout_s)] += 1
            except OSError:  # not even connected
                self.statuses["no answer"] += 1
