"""The ASGI app (Starlette) of cloudd's OpenAI API: routes, keys, bodies, slots, answers.

A generation request goes: key checked (401, body unread) -> body read within ``timeout_s`` and
``max_body_bytes`` (408 / 413, connection closed) -> parsed on a worker thread (a text prompt is
tokenized there, off the event loop; 400 naming the field) -> namespaced as its tenant's
(``tenants``) -> a request slot taken (503 with ``Retry-After: 1`` when ``max_requests`` are in
progress) -> started on the shared ``FleetClient`` (409 for the tenant's own id in flight) ->
answered whole, or streamed (``streaming.EventStream``). The client leaving cancels it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from cloudd.api_keys import ApiKeys
from cloudd.http_api.calls import AsyncCall
from cloudd.http_api.connection import peer_name
from cloudd.http_api.limits import HttpLimits, RequestSlots
from cloudd.http_api.request_body import BadRequest, decode_json, generate_from_body, include_usage_from_body
from cloudd.http_api.response_body import (
    ChunkBodies,
    completion_body,
    error_response,
    json_response,
    protocol_error_response,
)
from cloudd.http_api.streaming import ClientLeft, EventStream, WriteTimeout, until_disconnect
from cloudd.http_api.tenants import BadRequestId, Tenant
from cloudd.metrics import ServerMetrics
from shared.model.tokenizer import Tokenizer
from shared.protocol.messages import Error, Generate
from shared.transport.client import FleetClient, RequestFailed, RequestInFlight

log = logging.getLogger(__name__)
CLOSE = {"Connection": "close"}  # on answers that leave the body unread: it must not be read as a request


@dataclass(frozen=True)
class ApiContext:
    """What the handlers share. With ``api_keys``, every route needs a bearer token of that file
    and a request is served as the key's name (its ``robot_id`` and its tenant), except
    ``/health`` and ``/metrics`` while ``open_probes`` (cloudd sets it when the API is on loopback)."""

    client: FleetClient
    tokenizer: Tokenizer | None
    metrics: ServerMetrics
    model_name: str
    api_keys: ApiKeys | None = None
    open_probes: bool = True


class _BodyError(Exception):
    def __init__(self, response: Response):
        self.response = response


def make_app(ctx: ApiContext, limits: HttpLimits) -> ASGIApp:
    """The API as an ASGI app, every write bounded by ``limits.timeout_s``."""
    api = _Api(ctx, limits)
    routes = [Route("/v1/chat/completions", api.chat, methods=["POST"]),
              Route("/v1/completions", api.completions, methods=["POST"]),
              Route("/v1/models", api.models), Route("/health", api.health), Route("/metrics", api.metrics)]
    return WriteTimeout(Starlette(routes=routes, exception_handlers={HTTPException: _http_error}), limits.timeout_s)


class _Api:
    def __init__(self, ctx: ApiContext, limits: HttpLimits):
        self.ctx = ctx
        self.limits = limits
        self.slots = RequestSlots(limits.max_requests)
        tokenizer = ctx.tokenizer
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) if tokenizer is not None else frozenset()

    # --- routes ---

    async def models(self, request: Request) -> Response:
        if self._tenant(request) is None:
            return _unauthorized()
        return json_response(HTTPStatus.OK, {"object": "list", "data": [
            {"id": self.ctx.model_name, "object": "model", "created": 0, "owned_by": "fleetserve"}]})

    async def health(self, request: Request) -> Response:
        if not self.ctx.open_probes and self._tenant(request) is None:
            return _unauthorized()
        status = await asyncio.to_thread(self._health)
        return json_response(HTTPStatus.OK if status == "ok" else HTTPStatus.SERVICE_UNAVAILABLE, {"status": status})

    async def metrics(self, request: Request) -> Response:
        if not self.ctx.open_probes and self._tenant(request) is None:
            return _unauthorized()
        return Response(self.ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    # --- generation ---

    async def _generate(self, request: Request, chat: bool) -> Response:
        tenant = self._tenant(request)
        if tenant is None:
            return _unauthorized()
        try:
            raw = await self._body(request)
            client_request, core_request, include_usage = await asyncio.to_thread(self._parse, raw, chat, tenant)
        except _BodyError as e:
            return e.response
        except ClientLeft:
            log.info("HTTP client %s left before its request was read", _peer(request))
            return Response()
        except (BadRequest, BadRequestId) as e:
            return error_response(HTTPStatus.BAD_REQUEST, str(e), "invalid_request")
        if not self.slots.take():
            return error_response(HTTPStatus.SERVICE_UNAVAILABLE, f"{self.slots.limit} requests are in progress on "
                                  "this API: retry", "overloaded", {"Retry-After": "1"})
        try:
            call = AsyncCall(self.ctx.client, core_request, asyncio.get_running_loop())
        except RequestInFlight:
            self.slots.give()
            return error_response(HTTPStatus.CONFLICT, f"request_id {client_request.request_id!r} is already in "
                                  "flight: wait for its answer or use another id", "conflict")
        except ValueError as e:  # cannot be encoded (an int beyond 64 bits in its response_format, say)
            self.slots.give()
            return error_response(HTTPStatus.BAD_REQUEST, str(e), "invalid_request")
        model = self.ctx.model_name
        if core_request.stream:
            bodies = ChunkBodies(client_request.request_id, chat, model, _now(), include_usage)
            return EventStream(call, bodies, self.eos_token_ids, self.slots.give)
        try:
            return await self._complete(request, call, client_request.request_id, chat)
        finally:
            self.slots.give()

    async def _complete(self, request: Request, call: AsyncCall, client_id: str, chat: bool) -> Response:
        try:
            outcome = await until_disconnect(request.receive, call.outcome())
        except ClientLeft:
            call.cancel()
            log.info("HTTP client %s left before its answer: cancelled %s", _peer(request), call.request.request_id)
            return Response()
        if isinstance(outcome, Error):
            return protocol_error_response(outcome, call.request.request_id, client_id)
        return json_response(HTTPStatus.OK, completion_body(outcome, client_id, chat, self.ctx.model_name, _now()))

    # --- plumbing ---

    def _tenant(self, request: Request) -> Tenant | None:
        """The request's tenant: its API key's (None: no valid bearer token), or the anonymous
        tenant of an API without keys."""
        keys = self.ctx.api_keys
        if keys is None:
            return Tenant("")
        scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
        name = keys.name_of(token.strip()) if scheme.lower() == "bearer" else None
        return Tenant(name) if name is not None else None

    async def _body(self, request: Request) -> bytes:
        """The whole body, read within ``timeout_s``; _BodyError (408 or 413, the connection
        closed) past the time or ``max_body_bytes``; ClientLeft if the client leaves meanwhile."""
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")  # h11 has checked it is digits, one value
        if declared is not None and int(declared) > limit:
            raise _BodyError(_too_large(int(declared), limit))
        body = bytearray()
        try:
            async with asyncio.timeout(self.limits.timeout_s):
                async for piece in request.stream():
                    body += piece
                    if len(body) > limit:  # a chunked body says its size only as it comes
                        raise _BodyError(_too_large(len(body), limit))
        except TimeoutError:
            log.info("HTTP client %s sent no whole body within %g s", _peer(request), self.limits.timeout_s)
            raise _BodyError(error_response(HTTPStatus.REQUEST_TIMEOUT, f"no whole body within "
                                            f"{self.limits.timeout_s:g} s", "timeout", CLOSE)) from None
        except ClientDisconnect:
            raise ClientLeft from None
        return bytes(body)

    def _parse(self, raw: bytes, chat: bool, tenant: Tenant) -> tuple[Generate, Generate, bool]:
        """On a worker thread: the body as the client's ``Generate``, as the core's (its
        ``tenant``'s: ``Tenant.core_request``), and its ``include_usage``."""
        body: Any = decode_json(raw)
        request = generate_from_body(body, chat, self.ctx.tokenizer)
        return request, tenant.core_request(request), include_usage_from_body(body, request.stream)

    def _health(self) -> str:
        try:
            return self.ctx.client.health(timeout_s=5)
        except (TimeoutError, RequestFailed):
            return "unavailable"


def _unauthorized() -> Response:
    return error_response(HTTPStatus.UNAUTHORIZED, "a valid API key is needed: Authorization: Bearer <key>",
                          "unauthorized", {"WWW-Authenticate": "Bearer", **CLOSE})


def _too_large(size: int, limit: int) -> Response:
    return error_response(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {size} bytes exceeds {limit}", "too_large",
                          CLOSE)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 and 405, in OpenAI's error shape."""
    assert isinstance(exc, HTTPException)
    code = "not_found" if exc.status_code == HTTPStatus.NOT_FOUND else "method_not_allowed"
    return error_response(exc.status_code, f"no route {request.method} {request.url.path}", code, exc.headers)


def _peer(request: Request) -> str:
    return peer_name(request.scope.get("client"))


def _now() -> int:
    return int(time.time())
