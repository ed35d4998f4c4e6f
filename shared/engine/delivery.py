"""Delivery: each request's new tokens as a ``TokenDelta`` (their text, a stop string ending
the request), and the deltas of buffered requests until ``stream``/``drain`` takes them.

A request is *live* from ``open`` until it is fully delivered: its finishing delta returned
(unbuffered) or taken (buffered); then its per-request state is dropped and its id is free.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from shared.engine.detokenizer import IncrementalDetokenizer
from shared.engine.request import FinishReason, Request
from shared.engine.request_budget import RequestBudget, WorkMeter
from shared.engine.scheduler import Scheduler
from shared.engine.sampled_rows import SampledRows
from shared.engine.step_profile import StepProfile, timed_phase

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """What one request produced in one step (or its end)."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    detail: str | None = None  # why it ended, where the reason alone does not say (its budget)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Delivery:
    """The live requests' output state. Ends a request (through ``scheduler``) when its text
    reaches a stop string or its detokenizer raises; stamps ``finish_time`` with ``clock``;
    calls ``on_forget(request_id)`` once a request is fully delivered."""

    def __init__(self, scheduler: Scheduler, clock: Callable[[], float], on_forget: Callable[[str], None]):
        self.scheduler = scheduler
        self.clock = clock
        self.on_forget = on_forget
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}  # none without a tokenizer
        self.pending: dict[str, list[TokenDelta]] = defaultdict(list)  # buffered, not yet taken
        self.live: set[str] = set()
        self.buffered: set[str] = set()  # live ids whose deltas wait for stream/drain
        self.profile: StepProfile | None = None  # set by Engine.enable_profile

    def open(self, request_id: str, detokenizer: IncrementalDetokenizer | None, buffered: bool) -> None:
        """Start delivering ``request_id`` (its text through ``detokenizer``, if any)."""
        if detokenizer is not None:
            self.detokenizers[request_id] = detokenizer
        self.live.add(request_id)
        if buffered:
            self.buffered.add(request_id)

    def deliver(self, req: Request, tokens: list[int], reason: FinishReason | None,
                logprobs: Sequence[float] = (), detail: str | None = None) -> TokenDelta:
        """Turn new tokens into a delta; a stop string found here finishes the request.
        A stop token (reason STOP from the scheduler) is delivered as a token, not as text."""
        detok = self.detokenizers.get(req.request_id)
        text = ""
        if detok is not None and reason is not FinishReason.ERROR:
            try:
                text = detok.push(tokens[:-1] if reason == FinishReason.STOP else tokens)
                if detok.stopped and reason is None:
                    self.scheduler.finish(req, FinishReason.STOP)
                    reason = FinishReason.STOP
                if reason is not None:
                    text += detok.flush()
            except Exception:
                text, reason = "", self.scheduler.fail(req)
        if reason is not None:
            req.finish_time = self.clock()
        delta = TokenDelta(req.request_id, tokens, text, list(logprobs), reason, detail)
        if req.request_id in self.buffered:
            self.pending[req.request_id].append(delta)
        elif reason is not None:
            self._forget(req.request_id)
        return delta

    @timed_phase("detokenize")
    def deliver_step(self, batch: SampledRows, finished: Mapping[str, FinishReason]) -> list[TokenDelta]:
        """The delta of each request of ``batch``: its output since the step began (logprobs
        when it asked for them), and its reason in ``finished`` if it ended."""
        return [
            self.deliver(req, req.output_token_ids[n:], finished.get(req.request_id),
                         req.output_logprobs[n:] if req.sampling.logprobs else [])
            for req, n in zip(batch.requests, batch.num_outputs_before, strict=True)
        ]

    def end_overruns(self, batch: SampledRows, budget: RequestBudget) -> list[TokenDelta]:
        """Charge each request of ``batch`` its grammar's and detokenizer's work of this step
        (``RequestBudget.over``) and end each one over the budget alone: finish reason
        ``error``, its delta's ``detail`` naming the budget. Returns those deltas."""
        ended = []
        for overrun in budget.over((r.request_id, self._meters(r)) for r in batch.requests):
            req = self.scheduler.requests.get(overrun.work.request_id)
            if req is None or req.is_finished:
                continue
            log.warning("%s: it ends, the others go on", overrun.detail)
            self.scheduler.finish(req, FinishReason.ERROR)
            ended.append(self.deliver(req, [], FinishReason.ERROR, detail=overrun.detail))
        return ended

    def _meters(self, req: Request) -> list[WorkMeter]:
        detok = self.detokenizers.get(req.request_id)
        return [m.work for m in (req.grammar, detok) if m is not None]

    def take(self, request_id: str) -> list[TokenDelta]:
        """The deltas buffered for ``request_id`` since the last call (none for an unknown id)."""
        deltas = self.pending.pop(request_id, [])
        if deltas and deltas[-1].finished:
            self._forget(request_id)
        return deltas

    def _forget(self, request_id: str) -> None:
        """The request is over and fully delivered: drop its per-request state."""
        self.live.discard(request_id)
        self.buffered.discard(request_id)
        self.detokenizers.pop(request_id, None)
        self.on_forget(request_id)
