"""One HTTP connection: uvicorn's h11 protocol with a request-head deadline and quiet errors.

h11 parses strictly: a duplicate ``Content-Length`` that differs, a length that is not digits, a
``Transfer-Encoding`` other than ``chunked``, a head past ``MAX_HEAD_BYTES`` are a 4xx and the
connection closed; a chunked body is read as the body of its one request, so no body is ever
parsed as a next request. On top of it:

- **Head deadline** (uvicorn has none: its keep-alive timer is reset by every byte): each
  request head must be complete within ``timeout_s`` of the connection's start or of the end of
  the previous response, however slowly its bytes come, else the connection is closed,
  unanswered. A slow head costs a socket and a timer only: no request slot, no key check, no
  thread (the app runs only once the head is whole).
- **One log line per bad connection**, naming the client and the reason, with no traceback: a
  malformed request (answered with h11's status and a JSON error) and a head past its deadline
  log here; uvicorn's own generic lines for them are dropped.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from cloudd.http_api.response_body import error_response

log = logging.getLogger(__name__)
MAX_HEAD_BYTES = 16 * 1024  # a request line and headers past this are a 431 (h11's bound)
# uvicorn's generic log lines for what this module logs itself, with the client and the reason
_REPLACED = frozenset({"Invalid HTTP request received.", "ASGI callable returned without completing response."})


class _DropReplaced(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in _REPLACED


_WIRE_LOG = logging.getLogger(f"{__name__}.uvicorn")  # uvicorn's per-connection lines, as its own logger
_WIRE_LOG.addFilter(_DropReplaced())


class _ReasonKeepingConnection(h11.Connection):
    """h11's connection, keeping the protocol error that made it give up (for the answer and the
    log), and refusing a whole request head past ``MAX_HEAD_BYTES`` too: h11 bounds only a head
    still arriving, so one that came in a single read passed at any size."""

    error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            event = super().next_event()
            if isinstance(event, h11.Request) and (size := _head_bytes(event)) > MAX_HEAD_BYTES:
                raise h11.RemoteProtocolError(f"request head of {size} bytes exceeds {MAX_HEAD_BYTES}",
                                              error_status_hint=431)
            return event
        except h11.RemoteProtocolError as e:
            self.error = e
            raise


def _head_bytes(request: h11.Request) -> int:
    """The request line and headers as sent, give or take their separators."""
    return (len(request.method) + len(request.target) + 12
            + sum(len(name) + len(value) + 4 for name, value in request.headers.raw_items()))


class FleetH11Protocol(H11Protocol):
    """uvicorn's ``H11Protocol`` with a head deadline of ``config.timeout_keep_alive`` seconds
    (set to ``[serve] http_timeout_s``) and one log line per bad connection.

    The deadline is uvicorn's own keep-alive timer, armed at the connection's start too and no
    longer disarmed by each byte: only by a whole head (``handle_events`` at ``h11.Request``)."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.conn = _ReasonKeepingConnection(h11.SERVER, MAX_HEAD_BYTES)
        self.logger = _WIRE_LOG
        self.access_log = False  # a line per request is not cloudd's (uvicorn turns it on when its logger has handlers)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        # NOTE: uvicorn's first disarms the timer: every byte would restart a trickled head's deadline
        self.conn.receive_data(data)
        self.handle_events()

    def timeout_keep_alive_handler(self) -> None:
        partial, _ = self.conn.trailing_data
        if partial and not self.transport.is_closing():  # an idle keep-alive (nothing sent) closes without a line
            log.info("HTTP connection from %s closed: no whole request head within %g s (%d bytes sent)",
                     peer_name(self.client), self.timeout_keep_alive, len(partial))
        super().timeout_keep_alive_handler()

    def send_400_response(self, msg: str) -> None:
        """Answer the request h11 refused, with its status and reason, and close."""
        error = self.conn.error
        reason = str(error) if error is not None else msg
        status = error.error_status_hint if error is not None else 400
        log.info("HTTP %d to %s: %s", status, peer_name(self.client), reason)
        response = error_response(status, f"bad HTTP request: {reason}", "invalid_request")
        headers = [(k.encode(), v.encode()) for k, v in response.headers.items()] + [(b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=status, headers=headers), h11.Data(data=response.body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # its response had begun (a broken chunked body): only the close is left
            pass
        self.transport.close()


def peer_name(client: tuple[str, int] | None) -> str:
    """``host:port`` of an ASGI scope's or a protocol's ``client`` ("?" when unknown)."""
    return f"{client[0]}:{client[1]}" if client else "?"
