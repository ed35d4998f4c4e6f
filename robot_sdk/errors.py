"""Typed errors of the SDK: every failure a caller can act on has its own class.

All derive from ``PlanError`` and carry the server's ``message``, the ``request_id`` and the
protocol ``code`` when a daemon sent them. Bad arguments to the SDK itself (an unknown priority,
a skill without type hints) are ``ValueError``/``TypeError`` raised before anything is sent.
"""

from __future__ import annotations

from shared.protocol.messages import Error, ErrorCode


class PlanError(Exception):
    """A request did not produce a usable answer."""

    def __init__(self, message: str, request_id: str | None = None, code: ErrorCode | None = None,
                 text: str | None = None):
        super().__init__(message if request_id is None else f"{message} (request {request_id})")
        self.message = message
        self.request_id = request_id
        self.code = code
        self.text = text  # what the model had generated, when there was any


class DeadlineExceeded(PlanError):
    """The daemon could not start in time, or stopped the request at its deadline, or no
    answer arrived by the deadline (the request is then cancelled)."""


class Rejected(PlanError):
    """The daemon refused the request for now (overload, shutdown, the robot's quota): try later
    or elsewhere. ``retry_after_s``: when a quota would admit it again (None: not a quota)."""

    retry_after_s: float | None = None


class Forbidden(PlanError):
    """The request's priority class is not granted to this robot or API key (``forbidden``): it
    was refused, not served at a lower class. Send it at a granted class or ask the operator."""


class Unavailable(PlanError):
    """No daemon answered after every retry, or the daemon has no route to serve it."""


class InvalidPlan(PlanError):
    """The answer is not a plan over the declared skills; ``text`` holds the offending text."""


class InvalidRequest(PlanError):
    """The daemon found the request malformed or unservable (a bug on the caller's side)."""


class Cancelled(PlanError):
    """The request was cancelled (by ``cancel`` or by the daemon) before it completed."""


_BY_CODE: dict[ErrorCode, type[PlanError]] = {
    ErrorCode.DEADLINE: DeadlineExceeded,
    ErrorCode.REJECTED: Rejected,
    ErrorCode.FORBIDDEN: Forbidden,
    ErrorCode.UNAVAILABLE: Unavailable,
    ErrorCode.INVALID_REQUEST: InvalidRequest,
    ErrorCode.BAD_MESSAGE: InvalidRequest,
    ErrorCode.TOO_LARGE: InvalidRequest,
    ErrorCode.UNKNOWN_TYPE: InvalidRequest,
    ErrorCode.BAD_VERSION: InvalidRequest,
}


def error_from_reply(error: Error, request_id: str | None = None) -> PlanError:
    """The exception for a daemon's ``error`` reply (``PlanError`` itself for the rest)."""
    cls = _BY_CODE.get(error.code, PlanError)
    exc = cls(error.message, error.request_id or request_id, error.code)
    if isinstance(exc, Rejected) and error.retry_after_ms is not None:
        exc.retry_after_s = error.retry_after_ms / 1000
    return exc
