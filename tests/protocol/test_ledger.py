"""The idempotency ledger: a retry of a finished request gets its result, a different request
under the id is refused, and a finished entry keeps only what a retry needs."""

from __future__ import annotations

import dataclasses

from shared.protocol.messages import Error, ErrorCode, Generate, Result, Usage
from shared.transport.ledger import RequestLedger

REQUEST = Generate(request_id="r1", prompt_ids=tuple(range(1, 50_000)), tags=("x" * 64,) * 16)
RESULT = Result(request_id="r1", text="ok", finish_reason="stop", usage=Usage(3, 1))


def test_a_finished_entry_keeps_the_result_not_the_request():
    """Found in review: finished requests were kept whole for 300 s, unused tags included
    (300 requests with 0.9 MB of tags: +254 MB)."""
    ledger = RequestLedger()
    entry = ledger.open(REQUEST, b"peer")
    entry.text.append("ok")
    ledger.close("r1", RESULT, now=0.0)
    assert not any(isinstance(v, Generate) or (isinstance(v, tuple) and v == REQUEST.tags)
                   for v in vars(entry).values())
    assert entry.text == [] and entry.token_ids == []
    assert ledger.get("r1").rejoin(b"other", REQUEST) == [RESULT]
    (refusal,) = ledger.get("r1").rejoin(b"other", dataclasses.replace(REQUEST, tags=("y",)))
    assert isinstance(refusal, Error) and refusal.code is ErrorCode.INVALID_REQUEST


def test_a_cancel_is_answered_by_what_the_ledger_knows():
    """One answer for every daemon's cancel: unknown (or another robot's) ids are not found, a
    finished request's answer is its kept result, a live one subscribes the canceller."""
    ledger = RequestLedger()
    assert ledger.cancel("nobody", b"op").code is ErrorCode.NOT_FOUND
    entry = ledger.open(dataclasses.replace(REQUEST, robot_id="amr-1"), b"peer")
    assert ledger.cancel("r1", b"op", robot="amr-2").code is ErrorCode.NOT_FOUND
    assert ledger.cancel("r1", b"op", robot="amr-1") is None and entry.subscribers == [b"peer", b"op"]
    assert ledger.cancel("r1", b"op") is None and entry.subscribers == [b"peer", b"op"]  # once
    ledger.close("r1", RESULT, now=0.0)
    assert ledger.cancel("r1", b"late") == RESULT and b"late" not in entry.subscribers
