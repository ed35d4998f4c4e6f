"""Protocol replies -> OpenAI response bodies, and errors -> HTTP statuses.

Every body shows the client its own ``request_id`` (``client_id``), never the namespaced id the
core loop knows it by (``cloudd.http_api.tenants``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from starlette.responses import Response

from shared.protocol.messages import Chunk, Error, ErrorCode, Result

STATUS = {
    ErrorCode.BAD_MESSAGE: HTTPStatus.BAD_REQUEST,
    ErrorCode.INVALID_REQUEST: HTTPStatus.BAD_REQUEST,
    ErrorCode.UNKNOWN_TYPE: HTTPStatus.BAD_REQUEST,
    ErrorCode.BAD_VERSION: HTTPStatus.BAD_REQUEST,
    ErrorCode.TOO_LARGE: HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
    ErrorCode.NOT_FOUND: HTTPStatus.NOT_FOUND,
    ErrorCode.FORBIDDEN: HTTPStatus.FORBIDDEN,  # a priority class the key is not granted
    ErrorCode.DEADLINE: HTTPStatus.REQUEST_TIMEOUT,
    ErrorCode.REJECTED: HTTPStatus.TOO_MANY_REQUESTS,
    ErrorCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
    ErrorCode.INTERNAL: HTTPStatus.INTERNAL_SERVER_ERROR,
}


def json_response(status: int, body: dict, headers: dict[str, str] | None = None) -> Response:
    """``body`` as JSON (ASCII-escaped: a lone surrogate echoed in a message still encodes)."""
    return Response(json.dumps(body).encode(), status, headers, media_type="application/json")


def error_response(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> Response:
    """OpenAI's error shape: ``{"error": {"message", "type", "code"}}``."""
    return json_response(status, {"error": {"message": message, "type": code, "code": code}}, headers)


def protocol_error_response(error: Error, core_id: str, client_id: str) -> Response:
    """The HTTP answer to a protocol error: its status by code, ``Retry-After`` (whole seconds,
    rounded up) when a quota says when to retry, the core id in its text shown as the client's."""
    headers = {} if error.retry_after_ms is None else {"Retry-After": str(math.ceil(error.retry_after_ms / 1000))}
    return error_response(STATUS.get(error.code, HTTPStatus.INTERNAL_SERVER_ERROR),
                          _client_message(error, core_id, client_id), error.code.value, headers)


def _client_message(error: Error, core_id: str, client_id: str) -> str:
    return error.message.replace(core_id, client_id)


def completion_body(result: Result, client_id: str, chat: bool, model: str, created: int) -> dict:
    choice: dict[str, Any] = {"index": 0, "finish_reason": result.finish_reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": result.text}
    else:
        choice["text"] = result.text
    return {
        "id": client_id,
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
class ChunkBodies:
    """The OpenAI chunk bodies of one stream; ``include_usage`` as the client asked."""

    client_id: str
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

    def error(self, error: Error, core_id: str) -> dict:
        """The body of an error that ended the stream after its first chunk."""
        return {"error": {"message": _client_message(error, core_id, self.client_id), "code": error.code.value}}

    def _choice(self, text: str, finish: str | None) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "finish_reason": finish}
        delta: dict[str, Any] = {} if self.sent_text or not text else {"role": "assistant"}
        if text:
            delta["content"] = text
            self.sent_text = True
        return {"index": 0, "delta": delta, "finish_reason": finish}

    def _body(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.client_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = usage
        return body
