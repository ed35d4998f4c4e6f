"""The OpenAI-compatible HTTP surface of cloudd, plus ``/health`` and Prometheus ``/metrics``.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (a text prompt, tokenized
here), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. Streaming is server-sent events
(``data: {...}`` lines, then ``data: [DONE]``). Extra request fields a robot team may send:
``priority`` (safety | interactive | plan | background), ``deadline_ms``, ``robot_id`` (else
OpenAI's ``user``), ``request_id`` (the idempotency key; default: a fresh id), ``top_k`` and
``ignore_eos`` (as vLLM accepts them). ``temperature`` defaults to 1 as in OpenAI's API. Unknown OpenAI fields are ignored
as OpenAI's own server ignores what it does not use; ``n`` other than 1 is refused.

Every request becomes a protocol ``generate`` sent to the core loop over ``inproc`` through one
shared ``FleetClient``, so HTTP and ZeroMQ clients share one queue, one policy and one ledger.
A client that disconnects mid-stream has its request cancelled.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from cloudd.metrics import ServerMetrics
from shared.model.tokenizer import Tokenizer
from shared.protocol.messages import ChatMessage, Chunk, Error, ErrorCode, Generate, Priority, Result, Sampling
from shared.transport.client import FleetClient, RequestFailed

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


@dataclass(frozen=True)
class ApiContext:
    client: FleetClient
    tokenizer: Tokenizer | None
    metrics: ServerMetrics
    model_name: str


def make_http_server(host: str, port: int, ctx: ApiContext) -> ThreadingHTTPServer:
    """A threaded HTTP server bound to ``host:port`` (port 0: any free port); call
    ``serve_forever`` in a thread and ``shutdown`` to stop it."""
    handler = type("BoundHandler", (_Handler,), {"ctx": ctx})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


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


def _stream_body(rid: str, chat: bool, model: str, created: int, text: str | None, finish: str | None,
                 first: bool = False) -> dict:
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}


class _Handler(BaseHTTPRequestHandler):
    ctx: ApiContext
    protocol_version = "HTTP/1.1"
    server_version = "cloudd"

    def log_message(self, fmt: str, *args) -> None:  # route access logs to logging, not stderr
        log.debug("%s " + fmt, self.address_string(), *args)

    # --- routing ---

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
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
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self._error(HTTPStatus.NOT_FOUND, f"no route {path}", "not_found")
            return
        try:
            request = generate_from_body(self._body(), path == "/v1/chat/completions", self.ctx.tokenizer)
        except BadRequest as e:
            self._error(HTTPStatus.BAD_REQUEST, str(e), "invalid_request")
            return
        if request.stream:
            self._stream(request, chat=path == "/v1/chat/completions")
        else:
            self._complete(request, chat=path == "/v1/chat/completions")

    # --- generation ---

    def _complete(self, request: Generate, chat: bool) -> None:
        try:
            result = self.ctx.client.generate(request)
        except RequestFailed as e:
            self._protocol_error(e.error)
            return
        self._json(HTTPStatus.OK, _completion_body(result, chat, self.ctx.model_name, int(time.time())))

    def _stream(self, request: Generate, chat: bool) -> None:
        call = self.ctx.client.start(request)
        created = int(time.time())
        model = self.ctx.model_name
        started = False
        try:
            for reply in call.events():
                if isinstance(reply, Error):
                    if not started:
                        self._protocol_error(reply)
                        return
                    self._event({"error": {"message": reply.message, "code": reply.code.value}})
                    break
                if not started:
                    self._start_events()
                    started = True
                if isinstance(reply, Chunk):
                    if reply.text:
                        self._event(_stream_body(reply.request_id, chat, model, created, reply.text, None,
                                                 first=reply.seq == 0))
                elif isinstance(reply, Result):
                    body = _stream_body(reply.request_id, chat, model, created, None, reply.finish_reason)
                    body["usage"] = _usage(reply)
                    self._event(body)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            log.info("HTTP client left mid-stream: cancelling %s", request.request_id)
            threading.Thread(target=self._cancel_quietly, args=(request.request_id,), daemon=True).start()
        self.close_connection = True

    def _cancel_quietly(self, request_id: str) -> None:
        try:
            self.ctx.client.cancel(request_id)
        except (RequestFailed, TimeoutError):
            pass

    # --- plumbing ---

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise BadRequest(f"body of {length} bytes exceeds {MAX_BODY_BYTES}")
        try:
            return json.loads(self.rfile.read(length) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"body is not JSON: {e}") from None

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
        self._error(_STATUS.get(error.code, HTTPStatus.INTERNAL_SERVER_ERROR), error.message, error.code.value)

    def _error(self, status: HTTPStatus, message: str, code: str) -> None:
        self._json(status, {"error": {"message": message, "type": code, "code": code}})

    def _json(self, status: HTTPStatus, body: dict) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: HTTPStatus, payload: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)
