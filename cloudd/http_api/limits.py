"""The HTTP API's bounds: how long a client may take, how much it may send, how many requests
run at once."""

from __future__ import annotations

from dataclasses import dataclass

MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class HttpLimits:
    """``timeout_s`` bounds a request head (from the connection's start or the previous
    response's end), a request body, and each write to a client (a reader that stopped reading);
    ``max_requests`` bounds the generation requests in progress at once, counted from when their
    body is read and their key checked to when their answer is sent (connections are not
    counted: a connection costs a socket and no thread)."""

    timeout_s: float = 30.0
    max_requests: int = 256
    max_body_bytes: int = MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.max_requests < 1 or self.max_body_bytes < 1:
            raise ValueError(f"timeout_s > 0, max_requests >= 1, max_body_bytes >= 1, got {self}")


class RequestSlots:
    """Generation requests in progress, at most ``limit``. Used from the server's event loop
    only (no lock): ``take`` is False when all are taken; each True is paired with one ``give``."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_progress = 0

    def take(self) -> bool:
        if self.in_progress >= self.limit:
            return False
        self.in_progress += 1
        return True

    def give(self) -> None:
        assert self.in_progress > 0
        self.in_progress -= 1
