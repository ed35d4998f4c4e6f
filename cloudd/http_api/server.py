"""uvicorn serving the API on a thread of its own, with its own event loop; cloudd's entry point.

The listening socket is bound in the caller's thread (a taken port fails there, and port 0 is
known at once: ``server_address``); uvicorn then serves it with ``FleetH11Protocol``, no
WebSockets, no lifespan, no access log and no logging set-up of its own (cloudd's logging
applies). ``close`` stops accepting, lets answers in progress end for up to ``GRACE_S`` (then
cancels them), and joins the thread.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import uvicorn
from starlette.types import ASGIApp

from cloudd.api_keys import ApiKeys
from cloudd.http_api.app import ApiContext, make_app
from cloudd.http_api.connection import MAX_HEAD_BYTES, FleetH11Protocol
from cloudd.http_api.limits import HttpLimits
from cloudd.metrics import ServerMetrics
from shared.model.tokenizer import Tokenizer
from shared.transport.client import ClientConfig, FleetClient
from shared.transport.curve import ClientCurve
from shared.transport.loopback import is_loopback

if TYPE_CHECKING:
    import zmq

    from cloudd.server import ServeConfig

log = logging.getLogger(__name__)
GRACE_S = 5.0  # at close, answers in progress get this long (the core has ended their requests by then)


class HttpServer:
    """``app`` served on ``host:port`` (port 0: any free port) until ``close``; connections
    get ``timeout_s`` for each request head (``FleetH11Protocol``)."""

    def __init__(self, app: ASGIApp, host: str, port: int, timeout_s: float):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family)
        self.server_address: tuple[str, int] = self._socket.getsockname()[:2]
        config = uvicorn.Config(app, http=FleetH11Protocol, ws="none", lifespan="off", loop="asyncio",
                                log_config=None, access_log=False, server_header=False,
                                timeout_keep_alive=timeout_s, timeout_graceful_shutdown=GRACE_S,
                                h11_max_incomplete_event_size=MAX_HEAD_BYTES)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, name="http",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def for_api(cls, host: str, port: int, ctx: ApiContext, limits: HttpLimits = HttpLimits()) -> HttpServer:
        """The OpenAI API of ``ctx`` within ``limits``, served."""
        return cls(make_app(ctx, limits), host, port, limits.timeout_s)

    @property
    def url(self) -> str:
        host, port = self.server_address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=GRACE_S + 5)


class FleetFront(Protocol):
    """Where the HTTP API's client connects: a server's ``inproc`` endpoint in this process."""

    inproc_endpoint: str
    local_curve: ClientCurve | None
    context: zmq.Context


@dataclass
class HttpApi:
    """A running HTTP API: its server (on a thread of its own), its protocol client, its keys."""

    server: HttpServer
    client: FleetClient
    api_keys: ApiKeys | None

    def reload_keys(self) -> None:
        """SIGHUP: the API key file read again; a file that cannot be read keeps the keys in force."""
        if self.api_keys is None:
            return
        try:
            log.info("SIGHUP: %d HTTP API keys", self.api_keys.reload())
        except (OSError, ValueError) as e:
            log.error("SIGHUP: HTTP API keys not reloaded: %s", e)

    def close(self) -> None:
        self.server.close()
        self.client.close()


def start_http_api(serve: ServeConfig, fleet: FleetFront, tokenizer: Tokenizer, metrics: ServerMetrics,
                   model_name: str) -> HttpApi:
    """The HTTP API of ``serve``'s ``http_*`` settings (``http_max_connections`` bounds the
    generation requests in progress), a protocol client of ``fleet`` (a ``CloudServer`` or a
    ``ClusterFront``) over ``inproc`` with its CURVE client keys, served on a thread of its own."""
    client = FleetClient(fleet.inproc_endpoint, ClientConfig(curve=fleet.local_curve), context=fleet.context)
    api_keys = ApiKeys(serve.http_api_keys) if serve.http_api_keys else None
    ctx = ApiContext(client, tokenizer, metrics, model_name, api_keys, open_probes=is_loopback(serve.http_host))
    limits = HttpLimits(timeout_s=serve.http_timeout_s, max_requests=serve.http_max_connections)
    return HttpApi(HttpServer.for_api(serve.http_host, serve.http_port, ctx, limits), client, api_keys)
