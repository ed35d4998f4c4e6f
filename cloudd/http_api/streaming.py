"""Answers that wait on the engine: a client that leaves, or stops reading, cancels its request.

ASGI tells a server's app that its client left with an ``http.disconnect`` from ``receive`` (uvicorn
sends one when the connection closes, also when the client only half-closes it, as most
servers treat it). ``until_disconnect`` races the work against that message; the write
timeout (``WriteTimeout``, around every ``send``) turns a reader that stopped reading into
``ClientStalled``. Either way the request is cancelled through the shared ``FleetClient`` and
one line is logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cloudd.http_api.calls import AsyncCall, replies_by_step
from cloudd.http_api.connection import peer_name
from cloudd.http_api.response_body import ChunkBodies, protocol_error_response
from shared.protocol.messages import Chunk, Error, Result

log = logging.getLogger(__name__)
T = TypeVar("T")


class ClientLeft(Exception):
    """The client closed its connection before its answer was sent."""


class ClientStalled(Exception):
    """A write to the client did not finish within the write timeout: it stopped reading."""


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """``work``'s result; if the client leaves first, ``work`` is cancelled and ClientLeft raised.
    Call it only once the request's body has been read (every ``receive`` after that waits
    for the disconnect)."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        done, _ = await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # NOTE: also when this task itself is cancelled (the server shutting down)
        watch.cancel()
        if not work_task.done():
            work_task.cancel()
    if work_task not in done:
        raise ClientLeft
    return work_task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class WriteTimeout:
    """ASGI middleware: each ``send`` of ``app`` finishes within ``timeout_s`` or raises
    ClientStalled (uvicorn's ``send`` waits for as long as the client's socket buffers are full)."""

    def __init__(self, app: ASGIApp, timeout_s: float):
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def timed_send(message: Message) -> None:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await send(message)
            except TimeoutError:
                raise ClientStalled(f"no write finished within {self.timeout_s:g} s") from None

        try:
            await self.app(scope, receive, timed_send)
        except ClientStalled as e:
            log.info("HTTP client %s stopped reading (%s): connection closed", _peer(scope), e)


class EventStream(Response):
    """A stream's answer: server-sent events, one ``data:`` message per engine step, then
    ``data: [DONE]``; or, when the request is refused before its first chunk, that error as an
    HTTP status. The client leaving or stopping reading cancels the request. ``on_end`` runs
    once the stream has ended, however it ended."""

    def __init__(self, call: AsyncCall, bodies: ChunkBodies, eos_token_ids: frozenset[int], on_end: Callable[[], None]):
        # NOTE: Response.__init__ is not called: its empty body would declare Content-Length: 0
        self.status_code = 200
        self.media_type = "text/event-stream"
        self.background = None
        self.init_headers({"Cache-Control": "no-cache"})
        self.call = call
        self.bodies = bodies
        self.eos_token_ids = eos_token_ids
        self.on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await until_disconnect(receive, self._stream(scope, receive, send))
        except (ClientLeft, ClientStalled) as e:
            self.call.cancel()
            # NOTE: not raised on: uvicorn closes a connection whose answer was left unfinished
            log.info("HTTP client %s %s mid-stream: cancelled %s", _peer(scope),
                     "stopped reading" if isinstance(e, ClientStalled) else "left", self.call.request.request_id)
        finally:
            self.on_end()

    async def _stream(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False
        async for group in replies_by_step(self.call, self.eos_token_ids):
            if not started and isinstance(group[0], Error):  # refused before any chunk: an HTTP error
                await protocol_error_response(group[0], self.call.request.request_id,
                                              self.bodies.client_id)(scope, receive, send)
                return
            if not started:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                started = True
            result = group[-1] if isinstance(group[-1], Result) else None
            for body in self.bodies.step([r for r in group if isinstance(r, Chunk)], result):
                await _event(send, body)
            if isinstance(group[-1], Error):
                await _event(send, self.bodies.error(group[-1], self.call.request.request_id))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _event(send: Send, body: dict) -> None:
    await send({"type": "http.response.body", "body": b"data: " + json.dumps(body).encode() + b"\n\n",
                "more_body": True})


def _peer(scope: Scope) -> str:
    return peer_name(scope.get("client"))

