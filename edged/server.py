"""edged's daemon: the protocol on local endpoints, one local decode lane, escalation to cloudd.

``EdgeServer`` is the lane of a request front (``shared.transport.request_front``), bound for
the robot's processes only: by default one ``ipc://`` socket (0600) in a directory only the
robot's user may enter (0700, ``shared.transport.local_socket``); a loopback ``tcp://`` port only
with CURVE keys, since any local user may connect to one (``EdgeServeConfig``). The front's socket
thread answers health probes at once whatever the model is doing; its loop owns every request's
state, and the local worker thread (``edged.local_worker``), the cloud link
(``edged.cloud_link``) and the preparing thread (which tokenizes each new request and validates
its grammar, so a long prompt or a new grammar never holds the loop) report back through its
mailbox.

Each request ends with exactly one ``result`` (or one ``error`` when it could not be served at
all) saying where it was answered (``source``), why it was escalated (``escalation_reason``)
and whether it is a fallback (``degraded``):

- answered on the robot: ``source=edge``;
- escalated (``edged.escalation`` decides why) and the cloud answered in time: ``source=cloud``;
- escalated but the cloud failed, was refused by the circuit breaker, or did not answer by the
  deadline less ``fallback_margin_ms`` (``cloud_timeout_s`` without a deadline): the local plan,
  ``source=edge, degraded=true``, with ``detail`` saying what happened to the cloud.

An escalated request still gets a local plan computed as its fallback (unless the prompt does
not fit the robot). Streams: a request answered locally streams its chunks as they are made;
one answered by the cloud, or one whose local answer was replaced after the fact (low
confidence, invalid plan), gets the final text as one chunk before its result, and the result's
text is always the answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import zmq

from edged.cloud_link import CloudLink
from edged.escalation import EscalationPolicy, EscalationReason
from edged.escalation_state import Cloud, EscalationState, Local, Verdict
from edged.generation import LocalJob
from edged.local_worker import LocalWorker, QueuedJob
from shared.engine.detokenizer import IncrementalDetokenizer
from shared.engine.grammar.compiler import GrammarCompiler
from shared.engine.grammar.response_format import GrammarSpec, grammar_spec
from shared.engine.request import FinishReason
from shared.engine.sampling_params import SamplingParams
from shared.model.summary import ModelSummary, model_stats
from shared.plan.answer import StructuredAnswer
from shared.protocol.messages import Error, ErrorCode, Generate, Result, Source, Usage
from shared.transport.curve import Caller, check_server_keys
from shared.transport.local_socket import (EDGED_ENDPOINT, expand_endpoint, guarded_by_files, make_private_dir,
                                           restrict_socket)
from shared.transport.loopback import is_local_endpoint
from shared.transport.preparing import Admitting
from shared.transport.request_front import FrontConfig, Lane, Refused, RequestFront

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EdgeServeConfig:
    """The ``[serve]`` table of edged's config.

    Who reaches edged: an ``ipc://`` socket admits the robot's own user only (its directory is
    made 0700, or refused if open to others; the socket 0600); ``~`` is that user's home. With
    the ``curve_*`` keys, every endpoint takes only the admitted keys: a process whose key is in
    ``curve_authorized_dir`` is a client named by its key file (its request ids start with that
    name and "/", and it can cancel or rejoin only its own requests), one in ``curve_operator_dir``
    may cancel any (fleetctl). A ``tcp://`` port (or an abstract ``ipc://@name``),
    which any local user could connect to, is refused without them."""

    robot_id: str = "robot"  # this robot: escalations go to cloudd as it (with CURVE, its key's name)
    # ipc:// for processes on the robot; tcp:// on loopback (port 0 picks a free one) with CURVE only
    endpoints: tuple[str, ...] = (EDGED_ENDPOINT,)
    max_queue: int = 64  # local jobs waiting beyond this: new requests are rejected
    result_ttl_s: float = 300.0
    shutdown_grace_s: float = 10.0
    pinned_dir: str = "~/.cache/fleetserve/pinned"  # pinned prompts' KV on disk
    # longer chat text is refused before tokenizing (on the thread that answers health): the
    # 262,144 characters that cloudd's default 8,192-token context admits
    max_prompt_chars: int = 262_144
    execution_log: str = ""  # a journal of every execution (shared.transport.execution_log): "" = none
    # CURVE on every endpoint (shared.transport.curve): edged's key pair (.key_secret) and the
    # directories of the public keys it admits ("" = no CURVE: ipc:// endpoints only)
    curve_secret_key: str = ""
    curve_authorized_dir: str = ""  # the robot's processes, each a client named by its key
    curve_operator_dir: str = ""  # operators: see and stop every request

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("endpoints: give at least one")
        for ep in self.endpoints:
            if not is_local_endpoint(ep):
                raise ValueError(f"endpoints: {ep!r} is not local (use ipc:// or tcp:// on loopback)")
        check_server_keys(self.curve_secret_key, self.curve_authorized_dir, self.curve_operator_dir)
        unguarded = [ep for ep in self.endpoints if not guarded_by_files(ep)]
        if unguarded and not self.curve_secret_key:
            raise ValueError(f"endpoints: {unguarded[0]!r} admits every local user: give curve_secret_key and "
                             f"curve_authorized_dir (CURVE), or use an ipc:// socket file such as {EDGED_ENDPOINT}")
        if self.max_queue < 1 or self.result_ttl_s <= 0 or self.shutdown_grace_s < 0:
            raise ValueError("max_queue >= 1, result_ttl_s > 0, shutdown_grace_s >= 0")

    def front(self) -> FrontConfig:
        """The request front of these settings (``~`` in ipc:// paths expanded)."""
        return FrontConfig(daemon="edged", endpoints=tuple(expand_endpoint(ep) for ep in self.endpoints),
                           result_ttl_s=self.result_ttl_s, shutdown_grace_s=self.shutdown_grace_s,
                           execution_log=self.execution_log, curve_secret_key=self.curve_secret_key,
                           curve_authorized_dir=self.curve_authorized_dir, curve_operator_dir=self.curve_operator_dir)


@dataclass
class CloudCall:
    """The cloud's side of an escalated request: when it went out and when it is given up, and
    what came of it (``state.cloud`` says which of these hold)."""

    started: float | None = None  # set with give_up as the call goes out (Cloud.WAITING)
    give_up: float | None = None
    result: Result | None = None  # Cloud.ANSWERED
    error: str | None = None  # Cloud.FAILED: why the cloud gave no answer


@dataclass(eq=False)
class EdgeRequest:
    """One live request (the front's loop only): where it stands (``state``), why it was
    escalated (``reason``), its local job and its cloud call."""

    msg: Generate
    received: float
    prompt_ids: list[int]
    spec: GrammarSpec | None
    deadline: float | None
    answer: StructuredAnswer | None = None  # the local answer parsed under ``spec``, once it is done
    state: EscalationState = field(default_factory=lambda: EscalationState(Local.NONE))
    reason: EscalationReason | None = None
    local: QueuedJob | None = None
    call: CloudCall = field(default_factory=CloudCall)
    streamed: list[str] = field(default_factory=list)  # text chunks already streamed (local)

    @property
    def cloud_waiting(self) -> bool:
        return self.state.cloud is Cloud.WAITING


@dataclass(frozen=True)
class Prepared:
    """What the preparing thread made of a request."""

    prompt_ids: list[int]
    params: SamplingParams
    spec: GrammarSpec | None


@dataclass
class EdgeCounters:
    answered_local: int = 0
    answered_cloud: int = 0
    fallbacks: int = 0  # degraded local answers
    escalations: dict[str, int] = field(default_factory=dict)  # by reason
    cloud_errors: int = 0


class EdgeServer(Lane[Prepared]):
    """The robot's lane of a ``RequestFront``: each request runs on the local worker, and on the
    cloud link when ``policy`` escalates it."""

    def __init__(self, worker: LocalWorker, compiler: GrammarCompiler, policy: EscalationPolicy,
                 cloud: CloudLink | None, config: EdgeServeConfig, model: ModelSummary,
                 context: zmq.Context | None = None):
        self.worker = worker
        self.generator = worker.generator
        self.tokenizer = worker.generator.tokenizer
        self.compiler = compiler
        self.policy = policy
        self.cloud = cloud
        self.config = config
        self.model = model  # what the stats say it runs
        self.counters = EdgeCounters()
        self.live: dict[str, EdgeRequest] = {}
        front = config.front()
        for endpoint in front.endpoints:
            make_private_dir(endpoint)
        self.front: RequestFront[Prepared] = RequestFront(self, front, context)
        for endpoint in self.front.endpoints:
            restrict_socket(endpoint)
        # the local worker's and the cloud link's events, for the front's loop
        self.mailbox = self.front.mailbox
        self.endpoints = self.front.endpoints

    def close(self) -> None:
        self.worker.stop()
        if self.cloud is not None:
            self.cloud.close()

    def wait_ms(self) -> int:
        timers = [r.call.give_up for r in self.live.values() if r.cloud_waiting]
        if not timers:
            return 100
        return max(0, min(100, int((min(timers) - time.monotonic()) * 1000) + 1))

    def stats(self, caller: Caller, reply: Callable[[dict | Error], None]) -> None:
        reply(self.snapshot())

    # --- admission -----------------------------------------------------------------------------

    def refusal(self, msg: Generate) -> Error | None:
        """Before tokenizing (which runs on the preparing thread, so health and every other
        message are answered meanwhile): a full local queue, a prompt over ``max_prompt_chars``."""
        rid = msg.request_id
        if self.worker.depth >= self.config.max_queue:
            return Error(ErrorCode.REJECTED, f"overloaded: {self.config.max_queue} local jobs queued", rid)
        chars = sum(len(m.content) for m in msg.messages)
        if chars > self.config.max_prompt_chars:
            return Error(ErrorCode.INVALID_REQUEST, f"prompt of {chars} characters is over "
                         f"max_prompt_chars {self.config.max_prompt_chars}", rid)
        return None

    def prepare(self, msg: Generate) -> Prepared:
        """The preparing thread: ValueError for a request that cannot be served."""
        prompt = (self.tokenizer.encode_chat([m.as_dict() for m in msg.messages])
                  if msg.messages else list(msg.prompt_ids))
        spec = grammar_spec(msg.response_format)
        params = SamplingParams.from_wire(msg.sampling)
        if spec is not None:
            self.compiler.validate(spec)
        return Prepared(prompt, params, spec)

    def start(self, pending: Admitting, prepared: Prepared) -> None:
        msg, rid = pending.msg, pending.msg.request_id
        prompt, params = prepared.prompt_ids, prepared.params
        deadline = None if msg.deadline_ms is None else pending.received + msg.deadline_ms / 1000
        req = EdgeRequest(msg, pending.received, prompt, prepared.spec, deadline)
        own_s = self.worker.rate.seconds(len(prompt), params.max_tokens)
        wait_s = self.worker.wait_estimate_s(msg.priority.rank, deadline, own_s)
        req.reason = self.policy.before(msg, len(prompt), wait_s)
        if req.reason is EscalationReason.CONTEXT and (self.cloud is None or msg.escalation.value == "local"):
            raise Refused(Error(
                ErrorCode.INVALID_REQUEST,
                f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} does not fit the robot's "
                f"context of {self.policy.local_context} and "
                f"{'no cloud is configured' if self.cloud is None else 'the request is forced local'}", rid))
        self.live[rid] = req
        if req.reason is not EscalationReason.CONTEXT:
            self._start_local(req, params)
        if req.reason is not None:
            self._escalate(req)
        elif self.cloud is not None and self.policy.races(msg) and self.cloud.breaker.allow():
            req.state.cloud_to(Cloud.WAITING)
            self._call_cloud(req)

    def cancelled_before_start(self, request_id: str, prepared: Prepared) -> Result:
        return Result(request_id, "", FinishReason.ABORT.value, Usage(len(prepared.prompt_ids), 0),
                      source=Source.EDGE, detail="cancelled")

    # --- local ---------------------------------------------------------------------------------

    def _start_local(self, req: EdgeRequest, params: SamplingParams) -> None:
        rid = req.msg.request_id
        job = LocalJob(rid, req.prompt_ids, params, IncrementalDetokenizer(self.tokenizer, params.stop),
                       spec=req.spec, deadline=req.deadline)
        req.local = QueuedJob(
            job, req.msg.priority.rank,
            emit=lambda tokens, text: self.mailbox.post(lambda: self._on_local_tokens(rid, tokens, text)),
            done=lambda finished: self.mailbox.post(lambda: self._on_local_done(rid)),
            queued_at=time.monotonic(),
            estimate_s=self.worker.rate.seconds(len(req.prompt_ids), params.max_tokens),
        )
        req.state.local = Local.RUNNING
        self.worker.submit(req.local)

    def _on_local_tokens(self, rid: str, tokens: list[int], text: str) -> None:
        req = self.live.get(rid)
        if req is None or req.reason is not None or not req.msg.stream or not (tokens or text):
            return
        req.streamed.append(text)
        self._chunk(req, tokens, text, Source.EDGE)

    def _on_local_done(self, rid: str) -> None:
        req = self.live.get(rid)
        if req is None:
            return
        req.state.local_done()
        job = req.local.job
        if req.spec is not None:  # parsed once: for the escalation rules and for the result's plan
            req.answer = StructuredAnswer.parse(job.text, req.spec)
        if req.reason is None and job.error is None:
            reason = self.policy.after(req.msg, job, req.answer)
            if reason is not None:
                req.reason = reason
                self._escalate(req)
                return
            if req.cloud_waiting:  # raced, and the robot's plan stands: the cloud's is not needed
                self._cloud_failed(req, "the robot's plan came first")
                self.cloud.abandon(rid)
        self._settle(req)

    # --- cloud ---------------------------------------------------------------------------------

    def _count_escalation(self, reason: EscalationReason) -> None:
        self.counters.escalations[reason.value] = self.counters.escalations.get(reason.value, 0) + 1

    def _escalate(self, req: EdgeRequest) -> None:
        self._count_escalation(req.reason)
        if req.state.cloud is Cloud.UNASKED:  # (one cancelled meanwhile is answered as it stands)
            if self.cloud is None:
                self._cloud_failed(req, "no cloud is configured")
            elif not self.cloud.breaker.allow():
                self._cloud_failed(req, "the cloud link's circuit breaker is open")
            else:
                req.state.cloud_to(Cloud.WAITING)
                return self._call_cloud(req)
        self._settle(req)

    def _call_cloud(self, req: EdgeRequest) -> None:
        now = time.monotonic()
        req.call.started = now
        margin = self.cloud.config.fallback_margin_ms / 1000
        req.call.give_up = (req.deadline - margin) if req.deadline is not None else \
            now + self.cloud.config.cloud_timeout_s
        remaining_ms = None if req.deadline is None else max(1, int((req.deadline - now) * 1000))
        rid = req.msg.request_id
        self.cloud.submit(
            req.msg, robot_id=self.config.robot_id, deadline_ms=remaining_ms,
            on_result=lambda result: self.mailbox.post(lambda: self._on_cloud_result(rid, result)),
            on_error=lambda error: self.mailbox.post(lambda: self._on_cloud_error(rid, error)),
        )

    def _cloud_failed(self, req: EdgeRequest, why: str) -> bool:
        """The cloud is out of ``req``'s picture (``why``); False if it already was."""
        if not req.state.cloud_to(Cloud.FAILED):
            return False
        req.call.error = why
        return True

    def _on_cloud_result(self, rid: str, result: Result) -> None:
        req = self.live.get(rid)
        if req is None or not req.state.cloud_to(Cloud.ANSWERED):
            return
        req.call.result = result
        if req.reason is None:  # raced: the cloud's plan came first
            req.reason = EscalationReason.RACE
            self._count_escalation(req.reason)
        self._settle(req)

    def _on_cloud_error(self, rid: str, error: Error) -> None:
        req = self.live.get(rid)
        self.counters.cloud_errors += 1
        if req is not None and self._cloud_failed(req, f"cloud {error.code.value}: {error.message}"):
            self._settle(req)

    def work(self) -> None:
        """The cloud calls past their time: given up, answered locally."""
        now = time.monotonic()
        for req in list(self.live.values()):
            if req.cloud_waiting and now >= req.call.give_up:
                self._cloud_failed(req, "the cloud did not answer in time")
                self.cloud.abandon(req.msg.request_id)
                self._settle(req)

    # --- answers -------------------------------------------------------------------------------

    def _settle(self, req: EdgeRequest) -> None:
        """Answer ``req`` as its state's verdict says (``edged.escalation_state``), or keep waiting."""
        verdict = req.state.verdict()
        if verdict is Verdict.WAIT:
            return
        if verdict is Verdict.CLOUD:
            if req.state.local is Local.RUNNING:
                self.worker.cancel(req.msg.request_id)
            return self._answer(req, self._from_cloud(req, req.call.result))
        if verdict is Verdict.UNAVAILABLE:
            return self._finish(req, Error(ErrorCode.UNAVAILABLE, f"escalation needed ({req.reason.value}) and "
                                           f"{req.call.error}", req.msg.request_id))
        job = req.local.job
        if job.error is not None:
            self._finish(req, Error(ErrorCode.INTERNAL, job.error, req.msg.request_id))
            return
        self._answer(req, self._from_local(req, job))

    def _from_local(self, req: EdgeRequest, job: LocalJob) -> Result:
        degraded = req.reason is not None
        timings = {"e2e_s": time.monotonic() - req.received}
        if req.local.started_at is not None:
            timings["queue_s"] = req.local.started_at - req.received
        if job.first_token_s is not None:
            timings["ttft_s"] = job.first_token_s - req.received
        details = []
        if degraded:
            details.append(f"escalated ({req.reason.value}) but {req.call.error}: this is the robot's own plan")
        if job.finish_reason is FinishReason.DEADLINE:
            details.append("the deadline passed: the text is what was generated by then")
        return Result(
            request_id=req.msg.request_id, text=job.text, finish_reason=job.finish_reason.value,
            usage=Usage(len(job.prompt_ids), len(job.generated), job.reused_tokens),
            token_ids=tuple(job.generated), source=Source.EDGE,
            plan=None if req.answer is None else req.answer.plan, degraded=degraded,
            escalation_reason=req.reason.value if req.reason else None, timings=timings,
            detail="; ".join(details) or None,
        )

    def _from_cloud(self, req: EdgeRequest, cloud: Result) -> Result:
        timings = {f"cloud_{k}": v for k, v in cloud.timings.items()}
        timings["e2e_s"] = time.monotonic() - req.received
        timings["cloud_s"] = time.monotonic() - req.call.started
        return replace(cloud, request_id=req.msg.request_id, source=Source.CLOUD, degraded=False,
                       escalation_reason=req.reason.value, timings=timings)

    def _answer(self, req: EdgeRequest, result: Result) -> None:
        if req.msg.stream and result.text != "".join(req.streamed):
            self._chunk(req, list(result.token_ids), result.text, result.source)
        if result.source is Source.CLOUD:
            self.counters.answered_cloud += 1
        else:
            self.counters.answered_local += 1
            self.counters.fallbacks += result.degraded
        self._finish(req, result)

    def _finish(self, req: EdgeRequest, reply: Result | Error) -> None:
        self.live.pop(req.msg.request_id, None)
        self.front.finish(req.msg.request_id, reply)

    def _chunk(self, req: EdgeRequest, tokens: list[int], text: str, source: Source) -> None:
        self.front.emit(req.msg.request_id, tokens, text, source)

    # --- cancel, stats ---------------------------------------------------------------------------

    def cancel(self, request_id: str) -> None:
        self._cancel(self.live[request_id])

    def cancel_all(self, why: str) -> None:
        """Cancel every live request and wait (up to a second) for their results."""
        for req in list(self.live.values()):
            self._cancel(req)
        self.mailbox.run(wait_s=1.0, until=lambda: not self.live)

    def _cancel(self, req: EdgeRequest) -> None:
        """End ``req`` as cancelled: its local job stops (its result, finish reason ``abort``,
        follows); a cloud call is abandoned."""
        if self._cloud_failed(req, "cancelled") and req.call.started is not None:
            self.cloud.abandon(req.msg.request_id)
        if req.state.local is Local.RUNNING:
            req.reason = None  # a cancelled request is answered as it stands, not escalated
            self.worker.cancel(req.msg.request_id)
        elif req.state.local is Local.NONE:  # only the cloud had it: nothing was generated here
            self._answer(req, Result(req.msg.request_id, "", FinishReason.ABORT.value,
                                     Usage(len(req.prompt_ids), 0), source=Source.CLOUD,
                                     escalation_reason=req.reason.value, detail="cancelled"))
        else:
            self._settle(req)

    def snapshot(self) -> dict:
        """The ``stats`` reply."""
        g = self.generator
        c = self.counters
        return {
            "daemon": "edged", **model_stats(self.model.name, self.model), "robot_id": self.config.robot_id,
            "backend": g.backend.name, "quant": g.backend.quant, "products": g.backend.products,
            "max_len": g.backend.max_len,
            "draining": self.front.draining, "live": len(self.live), "local_queue": self.worker.depth,
            "requests": self.front.counters.requests, "answered_local": c.answered_local,
            "answered_cloud": c.answered_cloud, "fallbacks": c.fallbacks, "rejected": self.front.counters.rejected,
            "escalations": dict(c.escalations),
            "cloud_errors": c.cloud_errors,
            "cloud": None if self.cloud is None else {"endpoint": self.cloud.endpoint,
                                                      "breaker": self.cloud.breaker.state.value},
            "pinned": [{"name": p.name, "tokens": len(p.token_ids), "from_disk": p.from_disk}
                       for p in g.pinned.values()],
            "speculation": {"enabled": g.speculation.enabled, "drafted_tokens": g.drafted_tokens,
                            "accepted_drafts": g.accepted_drafts,
                            "acceptance_rate": round(g.accepted_drafts / max(g.drafted_tokens, 1), 3)},
            "decode_tok_s": round(self.worker.rate.decode_tok_s, 1),
            "prefill_tok_s": round(self.worker.rate.prefill_tok_s, 1),
        }
