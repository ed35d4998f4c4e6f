"""The OpenAI-compatible HTTP surface of cloudd, plus ``/health`` and Prometheus ``/metrics``.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (a text prompt, tokenized
here), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. Streaming is server-sent events
(``data: {...}`` lines, then ``data: [DONE]``). Extra request fields a robot team may send:
``priority`` (safety | interactive | plan | background), ``deadline_ms``, ``robot_id`` (else
OpenAI's ``user``), ``request_id`` (the idempotency key; default: a fresh id), ``top_k`` and
``ignore_eos`` (as vLLM accepts them). ``temperature`` defaults to 1 as in OpenAI's API. Unknown
OpenAI fields are ignored as OpenAI's own server ignores what it does not use; ``n`` other than 1
is refused. Integers out of the protocol's range (``max_tokens``, ``seed``, ``top_k``,
``deadline_ms``; see ``shared.protocol.messages``) and bodies that cannot be encoded are a 400
naming the field; a ``request_id`` already in flight is a 409 (two callers cannot share its
replies).

Streams follow OpenAI's chunks. A stream sends at most one ``data:`` message per engine step: a
step's text, with ``finish_reason`` on the message of the step that ended the request, not in a
message of its own, which clients such as ``vllm bench serve`` count as one more inter-token gap
(a request ended by a stop string or a finished grammar may still get one: see
``_replies_by_step``). ``stream_options: {"include_usage": true}`` (only with ``"stream": true``,
else 400) adds ONE last chunk before ``[DONE]`` whose ``choices`` is ``[]`` and whose ``usage``
holds ``prompt_tokens``, ``completion_tokens`` (the tokens generated, counted by the engine) and
``total_tokens``; every other chunk then carries ``"usage": null``. Without it no chunk has a
``usage`` key, as in OpenAI's API.

Every request becomes a protocol ``generate`` sent to the core loop over ``inproc`` through one
shared ``FleetClient``, so HTTP and ZeroMQ clients share one queue, one policy and one ledger.
A client that disconnects mid-stream has its request cancelled.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Protocol

from cloudd.api_keys import ApiKeys
from cloudd.metrics import ServerMetrics
from shared.engine.request import stop_reason
from shared.model.tokenizer import Tokenizer
from shared.protocol.messages import ChatMessage, Chunk, Error, ErrorCode, Generate, Priority, Result, Sampling
from shared.transport.client import Call, ClientConfig, FleetClient, Reply, RequestFailed, RequestInFlight
from shared.transport.curve import ClientCurve
from shared.transport.loopback import is_loopback

if TYPE_CHECKING:
    import zmq

    from cloudd.server import ServeConfig


class FleetFront(Protocol):
    """Where the HTTP API's client connects: a server's ``inproc`` endpoint in this process."""

    inproc_endpoint: str
    local_curve: ClientCurve | None
    context: zmq.Context

log = logging.getLogger(__name__)

_STATUS = {
    ErrorCode.BAD_MESSAGE: HTTPStatus.BAD_REQUEST,
    ErrorCode.INVALID_REQUEST: HTTPStatus.BAD_REQUEST,
    ErrorCode.UNKNOWN_TYPE: HTTPStatus.BAD_REQUEST,
    ErrorCode.BAD_VERSION: HTTPStatus.BAD_REQUEST,
    ErrorCode.TOO_LARGE: HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
    ErrorCode.NOT_FOUND: HTTPStatus.NOT_FOUND,
    ErrorCode.DEADLINE: HTTPStatus.REQUEST_TIMEOUT,
    ErrorCode.REJECTED: HTTPStatus.TOO_MANY_REQUESTS,
    ErrorCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
    ErrorCode.INTERNAL: HTTPStatus.INTERNAL_SERVER_ERROR,
}
MAX_BODY_BYTES = 1 << 20


class BadRequest(ValueError):
    """The HTTP body is not a request we can serve; the message says why."""


class BodyTooLarge(BadRequest):
    """A body past ``MAX_BODY_BYTES``: answered 413, unread, and the connection closed (its bytes
    must not be parsed as the next request)."""


@dataclass(frozen=True)
class ApiContext:
    """What the handlers share. With ``api_keys``, every route needs a bearer token of that file
    and a request is served as the key's name (its ``robot_id``), except ``/health`` and
    ``/metrics`` while ``open_probes`` (cloudd sets it when the API is on loopback)."""

    client: FleetClient
    tokenizer: Tokenizer | None
    metrics: ServerMetrics
    model_name: str
    api_keys: ApiKeys | None = None
    open_probes: bool = True


def make_http_server(host: str, port: int, ctx: ApiContext, timeout_s: float = 30.0,
                     max_connections: int = 256) -> ThreadingHTTPServer:
    """A threaded HTTP server bound to ``host:port`` (port 0: any free port); call
    ``serve_forever`` in a thread and ``shutdown`` to stop it.

    A connection that sends nothing for ``timeout_s`` (a half-sent request, an idle keep-alive,
    a stream reader that stopped reading) is closed. Beyond ``max_connections`` open at once, a
    new connection is answered 503 and closed at once, without a thread of its own."""
    handler = type("BoundHandler", (_Handler,), {"ctx": ctx, "timeout": timeout_s})
    return _BoundedHTTPServer((host, port), handler, max_connections)


@dataclass
class HttpApi:
    """A running HTTP API: its server (on a thread of its own), its protocol client, its keys."""

    server: ThreadingHTTPServer
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
        self.server.shutdown()
        self.client.close()


def start_http_api(serve: ServeConfig, fleet: FleetFront, tokenizer: Tokenizer, metrics: ServerMetrics,
                   model_name: str) -> HttpApi:
    """The HTTP API of ``serve``'s ``http_*`` settings, a protocol client of ``fleet`` (a
    ``CloudServer`` or a ``ClusterFront``) over ``inproc`` with its CURVE client keys, served on
    a thread of its own."""
    client = FleetClient(fleet.inproc_endpoint, ClientConfig(curve=fleet.local_curve), context=fleet.context)
    api_keys = ApiKeys(serve.http_api_keys) if serve.http_api_keys else None
    server = make_http_server(serve.http_host, serve.http_port,
                              ApiContext(client, tokenizer, metrics, model_name, api_keys,
                                         open_probes=is_loopback(serve.http_host)),
                              timeout_s=serve.http_timeout_s, max_connections=serve.http_max_connections)
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return HttpApi(server, client, api_keys)


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them."""

    daemon_threads = True
    # the listen backlog: socketserver's 5 dropped the SYNs of a burst of connections, and each
    # retried after 1-3 s (350 connections opened at once took 57 s to be accepted)
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int):
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def finish_request(self, request, client_address) -> None:
        """The connection's handler, then its slot given back, before socketserver closes the
        socket: a client that has seen its connection end can open the next one at once (given
        back after the close, the slot was still taken for a moment, and that connection got a 503)."""
        try:
            super().finish_request(request, client_address)
        finally:
            self._slots.release()


# --- OpenAI body -> protocol ---------------------------------------------------------------------


def generate_from_body(body: dict, chat: bool, tokenizer: Tokenizer | None) -> Generate:
    """The protocol request for an OpenAI chat or completions body; BadRequest names a bad field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is supported")
    if chat:
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise BadRequest("messages must be a non-empty list")
        messages = tuple(_chat_message(i, m) for i, m in enumerate(raw))
        prompt_ids: tuple[int, ...] = ()
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("prompt must be a non-empty string")
        if tokenizer is None:
            raise BadRequest("this model has no tokenizer: use token ids over the protocol")
        messages, prompt_ids = (), tuple(tokenizer.encode(prompt))
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 256))
    try:
        sampling = Sampling(
            max_tokens=_typed(max_tokens, int, "max_tokens"),
            temperature=float(_typed(body.get("temperature", 1.0), (int, float), "temperature")),
            top_p=float(_typed(body.get("top_p", 1.0), (int, float), "top_p")),
            top_k=_typed(body.get("top_k", 0), int, "top_k"),
            seed=_typed(body.get("seed"), (int, type(None)), "seed"),
            stop=tuple(_typed(s, str, "stop") for s in stop),
            ignore_eos=bool(body.get("ignore_eos", False)),
            logprobs=bool(body.get("logprobs", False)),
        )
        priority = Priority(body.get("priority", Priority.PLAN.value))
    except ValueError as e:
        raise BadRequest(str(e)) from None
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "text":
        response_format = None
    try:
        return Generate(
            request_id=_typed(body.get("request_id") or f"http-{uuid.uuid4().hex}", str, "request_id"),
            messages=messages,
            prompt_ids=prompt_ids,
            sampling=sampling,
            response_format=response_format,
            priority=priority,
            deadline_ms=_typed(body.get("deadline_ms"), (int, type(None)), "deadline_ms"),
            robot_id=_typed(body.get("robot_id", body.get("user", "")) or "", str, "robot_id"),
            stream=bool(body.get("stream", False)),
        )
    except ValueError as e:
        raise BadRequest(str(e)) from None


def include_usage_from_body(body: dict, stream: bool) -> bool:
    """OpenAI's ``stream_options.include_usage`` (absent or null: false). BadRequest when
    ``stream_options`` is not an object, ``include_usage`` not a bool, or either comes without
    ``"stream": true`` (OpenAI refuses that too). Other keys of ``stream_options`` are ignored."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise BadRequest(f"stream_options must be an object, not {type(options).__name__}")
    if not stream:
        raise BadRequest("stream_options is only allowed when stream is true")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise BadRequest(f"stream_options.include_usage must be a bool, not {type(include).__name__}")
    return bool(include)


def _chat_message(i: int, m: Any) -> ChatMessage:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadRequest(f"messages[{i}] must be an object with a string role")
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    if not isinstance(content, str):
        raise BadRequest(f"messages[{i}].content must be a string")
    return ChatMessage(m["role"], content)


def _typed(value: Any, types: type | tuple[type, ...], name: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, types):
        raise BadRequest(f"{name} has the wrong type ({type(value).__name__})")
    return value


# --- protocol -> OpenAI body ---------------------------------------------------------------------


def _completion_body(result: Result, chat: bool, model: str, created: int) -> dict:
    choice: dict[str, Any] = {"index": 0, "finish_reason": result.finish_reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": result.text}
    else:
        choice["text"] = result.text
    return {
        "id": result.request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": _usage(result),
        "fleetserve": {"source": result.source.value, "timings": result.timings, "detail": result.detail},
    }


def _usage(result: Result) -> dict:
    u = result.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


@dataclass
class _ChunkBodies:
    """The OpenAI chunk bodies of one stream; ``include_usage`` as the client asked."""

    rid: str
    chat: bool
    model: str
    created: int
    include_usage: bool
    sent_text: bool = False  # the chat role goes out once, with the first text

    def step(self, chunks: list[Chunk], result: Result | None) -> list[dict]:
        """The bodies for one step's replies: its text (and finish reason, if it ended the
        request) in one chunk unless both are empty, then the usage chunk if asked and ended."""
        text = "".join(c.text for c in chunks)
        finish = result.finish_reason if result is not None else None
        bodies = [self._body([self._choice(text, finish)])] if text or finish else []
        if result is not None and self.include_usage:
            bodies.append(self._body([], _usage(result)))
        return bodies

    def _choice(self, text: str, finish: str | None) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "finish_reason": finish}
        delta: dict[str, Any] = {} if self.sent_text or not text else {"role": "assistant"}
        if text:
            delta["content"] = text
            self.sent_text = True
        return {"index": 0, "delta": delta, "finish_reason": finish}

    def _body(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = usage
        return body


def _replies_by_step(call: Call, request: Generate, eos_token_ids: frozenset[int]) -> Iterator[list[Reply]]:
    """The call's replies in groups, one group per SSE message: a chunk with the replies already
    queued behind it, ending at the result or error. The server sends a request's last chunk and
    its result in the same step; when the chunk is known to be the last (``max_tokens`` reached,
    or end-of-sequence) the group waits for that result, so the finish reason rides on the text.
    A stop string or a finished grammar is not known from the chunk: its result joins the text
    when it is already queued, else it comes in a message of its own."""
    num_tokens = 0
    while True:
        group = [_next_reply(call, None)]
        while isinstance(group[-1], Chunk):
            num_tokens += len(group[-1].token_ids)
            last = _ends_request(group[-1], num_tokens, request.sampling, eos_token_ids)
            reply = _next_reply(call, None if last else 0)
            if reply is None:
                break
            group.append(reply)
        yield group
        if not isinstance(group[-1], Chunk):
            return


def _ends_request(chunk: Chunk, num_tokens: int, sampling: Sampling, eos_token_ids: frozenset[int]) -> bool:
    """Whether the engine surely finished the request with this chunk (its ``num_tokens``-th
    token so far), by the engine's own stop rule; a stop string or a finished grammar is not
    known here (the caller then waits for the result as a reply of its own)."""
    token = chunk.token_ids[-1] if chunk.token_ids else None
    return stop_reason(sampling, token, eos_token_ids, False, num_tokens) is not None


def _next_reply(call: Call, timeout_s: float | None) -> Reply | None:
    """The call's next reply, waiting up to ``timeout_s`` (None: for ever; 0: only one already
    queued); None if there is none by then."""
    try:
        return next(call.events(timeout_s))
    except TimeoutError:
        return None


class _Handler(BaseHTTPRequestHandler):
    ctx: ApiContext
    _key_name = ""  # the API key of the request being handled (with API keys)
    protocol_version = "HTTP/1.1"
    server_version = "cloudd"

    def log_message(self, fmt: str, *args) -> None:  # route access logs to logging, not stderr
        log.debug("%s " + fmt, self.address_string(), *args)

    # --- routing ---

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if not (path in ("/health", "/metrics") and self.ctx.open_probes) and self._refused():
            return
        if path == "/health":
            try:
                status = self.ctx.client.health(timeout_s=5)
            except (TimeoutError, RequestFailed):
                status = "unavailable"
            self._json(HTTPStatus.OK if status == "ok" else HTTPStatus.SERVICE_UNAVAILABLE, {"status": status})
        elif path == "/metrics":
            self._send(HTTPStatus.OK, self.ctx.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/v1/models":
            self._json(HTTPStatus.OK, {"object": "list", "data": [
                {"id": self.ctx.model_name, "object": "model", "created": 0, "owned_by": "fleetserve"}]})
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no route {path}", "not_found")

    def do_POST(self) -> None:
        path = self.path.split("?")[0]
        if self._refused():
            return
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self._error(HTTPStatus.NOT_FOUND, f"no route {path}", "not_found")
            return
        try:
            body = self._body()
            request = generate_from_body(body, path == "/v1/chat/completions", self.ctx.tokenizer)
            include_usage = include_usage_from_body(body, request.stream)
        except BodyTooLarge as e:
            self.close_connection = True
            self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, str(e), "too_large")
            return
        except BadRequest as e:
            self._error(HTTPStatus.BAD_REQUEST, str(e), "invalid_request")
            return
        if self.ctx.api_keys is not None:
            request = replace(request, robot_id=self._key_name)
        if request.stream:
            self._stream(request, path == "/v1/chat/completions", include_usage)
        else:
            self._complete(request, chat=path == "/v1/chat/completions")

    # --- generation ---

    def _complete(self, request: Generate, chat: bool) -> None:
        try:
            call = self._start(request)
            result = call.result() if call is not None else None
        except RequestFailed as e:
            self._protocol_error(e.error)
            return
        if result is None:
            return
        self._json(HTTPStatus.OK, _completion_body(result, chat, self.ctx.model_name, int(time.time())))

    def _stream(self, request: Generate, chat: bool, include_usage: bool) -> None:
        call = self._start(request)
        if call is None:
            return
        tokenizer = self.ctx.tokenizer
        eos = frozenset(tokenizer.eos_token_ids) if tokenizer is not None else frozenset()
        bodies = _ChunkBodies(request.request_id, chat, self.ctx.model_name, int(time.time()), include_usage)
        started = False
        try:
            for group in _replies_by_step(call, request, eos):
                if not started and isinstance(group[0], Error):  # refused before any chunk: an HTTP error
                    self._protocol_error(group[0])
                    return
                if not started:
                    self._start_events()
                    started = True
                result = group[-1] if isinstance(group[-1], Result) else None
                for body in bodies.step([r for r in group if isinstance(r, Chunk)], result):
                    self._event(body)
                if isinstance(group[-1], Error):
                    self._event({"error": {"message": group[-1].message, "code": group[-1].code.value}})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, TimeoutError):  # gone, or stopped reading
            log.info("HTTP client left mid-stream: cancelling %s", request.request_id)
            threading.Thread(target=self._cancel_quietly, args=(request.request_id,), daemon=True).start()
        self.close_connection = True

    def _start(self, request: Generate) -> Call | None:
        """The request's call, or None after answering 409 (its id is in flight on this API)
        or 400 (it cannot be encoded: an int beyond 64 bits in its response_format, say)."""
        try:
            return self.ctx.client.start(request)
        except RequestInFlight as e:
            self._error(HTTPStatus.CONFLICT, str(e), "conflict")
        except ValueError as e:
            self._error(HTTPStatus.BAD_REQUEST, str(e), "invalid_request")
        return None

    def _cancel_quietly(self, request_id: str) -> None:
        try:
            self.ctx.client.cancel(request_id)
        except (RequestFailed, TimeoutError):
            pass

    # --- plumbing ---

    def _refused(self) -> bool:
        """With API keys: answer 401 (and True) unless the request bears a known token; the
        key's name is then ``_key_name``. The body of a refused POST is left unread."""
        if self.ctx.api_keys is None:
            return False
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        name = self.ctx.api_keys.name_of(token.strip()) if scheme.lower() == "bearer" else None
        if name is None:
            self.close_connection = True
            self._error(HTTPStatus.UNAUTHORIZED, "a valid API key is needed: Authorization: Bearer <key>",
                        "unauthorized", {"WWW-Authenticate": "Bearer"})
            return True
        self._key_name = name
        return False

    def _body(self) -> Any:
        declared = self.headers.get("Content-Length") or "0"
        if not declared.isdigit():  # NOTE: int() takes "-1" (read until close) and "1_000"
            self.close_connection = True  # where this body ends is unknown
            raise BadRequest(f"Content-Length must be a number of bytes, got {declared!r}")
        length = int(declared)
        if length > MAX_BODY_BYTES:
            raise BodyTooLarge(f"body of {length} bytes exceeds {MAX_BODY_BYTES}")
        try:
            return json.loads(self.rfile.read(length) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"body is not JSON: {e}") from None
        except RecursionError:
            raise BadRequest("body is nested too deeply") from None

    def _start_events(self) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()

    def _event(self, body: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        self.wfile.flush()

    def _protocol_error(self, error: Error) -> None:
        headers = {} if error.retry_after_ms is None else {"Retry-After": str(math.ceil(error.retry_after_ms / 1000))}
        self._error(_STATUS.get(error.code, HTTPStatus.INTERNAL_SERVER_ERROR), error.message, error.code.value, headers)

    def _error(self, status: HTTPStatus, message: str, code: str, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps({"error": {"message": message, "type": code, "code": code}}).encode(),
                   "application/json", headers)

    def _json(self, status: HTTPStatus, body: dict) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: HTTPStatus, payload: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)
