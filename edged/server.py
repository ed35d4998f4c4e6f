"""edged's daemon: the protocol on local endpoints, one local decode lane, escalation to cloudd.

One front thread owns the ROUTER socket (bound to an ``ipc://`` path and a loopback ``tcp://``
port for the robot's processes) and every request's state; nothing else touches either. The
local worker thread (``edged.local_worker``) and the cloud link (``edged.cloud_link``) report
back through an event queue that wakes the front thread, so health probes are answered at once
whatever the model is doing. So does the preparing thread, which tokenizes each new request and
validates its grammar: a long prompt or a new grammar (hundreds of milliseconds) never holds
the front thread.

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

import functools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import zmq

from edged.cloud_link import CloudLink
from edged.escalation import EscalationPolicy, EscalationReason, parse_structured
from edged.generation import LocalJob
from edged.local_worker import LocalWorker, QueuedJob
from shared.engine.detokenizer import IncrementalDetokenizer
from shared.engine.grammar.compiler import GrammarCompiler
from shared.engine.grammar.response_format import GrammarSpec, grammar_spec
from shared.engine.request import FinishReason
from shared.engine.sampling_params import SamplingParams
from shared.model.summary import ModelSummary, model_stats
from shared.protocol.codec import ProtocolError, encode
from shared.protocol.messages import (
    Cancel, Chunk, Error, ErrorCode, Generate, Health, Message, Result, Source, Stats, Usage,
)
from shared.transport.execution_log import ExecutionLog
from shared.transport.ledger import LedgerEntry, RequestLedger
from shared.transport.loopback import is_local_endpoint
from shared.transport.mailbox import Mailbox
from shared.transport.preparing import Admitting, Preparer
from shared.transport.router import incoming, router_socket, send_nowait

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EdgeServeConfig:
    """The ``[serve]`` table of edged's config."""

    robot_id: str = "robot"  # this robot: escalations go to cloudd as it (with CURVE, its key's name)
    # ipc:// for processes on the robot, tcp:// on loopback (port 0 picks a free one)
    endpoints: tuple[str, ...] = ("ipc:///tmp/fleetserve-edged.sock", "tcp://127.0.0.1:5556")
    max_queue: int = 64  # local jobs waiting beyond this: new requests are rejected
    result_ttl_s: float = 300.0
    shutdown_grace_s: float = 10.0
    pinned_dir: str = "~/.cache/fleetserve/pinned"  # pinned prompts' KV on disk
    # longer chat text is refused before tokenizing (on the thread that answers health): the
    # 262,144 characters that cloudd's default 8,192-token context admits
    max_prompt_chars: int = 262_144
    execution_log: str = ""  # a journal of every execution (shared.transport.execution_log): "" = none

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("endpoints: give at least one")
        for ep in self.endpoints:
            if not is_local_endpoint(ep):
                raise ValueError(f"endpoints: {ep!r} is not local (use ipc:// or tcp:// on loopback)")
        if self.max_queue < 1 or self.result_ttl_s <= 0 or self.shutdown_grace_s < 0:
            raise ValueError("max_queue >= 1, result_ttl_s > 0, shutdown_grace_s >= 0")


@dataclass(eq=False)
class EdgeRequest:
    """One live request's state (front thread only)."""

    msg: Generate
    entry: LedgerEntry
    received: float
    prompt_ids: list[int]
    spec: GrammarSpec | None
    deadline: float | None
    reason: EscalationReason | None = None
    local: QueuedJob | None = None
    local_done: bool = False
    cloud_result: Result | None = None
    cloud_error: str | None = None
    cloud_started: float | None = None
    cloud_give_up: float | None = None
    streamed: list[str] = field(default_factory=list)  # text chunks already streamed (local)

    @property
    def cloud_waiting(self) -> bool:
        return self.cloud_started is not None and self.cloud_result is None and self.cloud_error is None


@dataclass(frozen=True)
class Prepared:
    """What the preparing thread made of a request."""

    prompt_ids: list[int]
    params: SamplingParams
    spec: GrammarSpec | None


@dataclass
class EdgeCounters:
    requests: int = 0
    answered_local: int = 0
    answered_cloud: int = 0
    fallbacks: int = 0  # degraded local answers
    rejected: int = 0
    escalations: dict[str, int] = field(default_factory=dict)  # by reason
    cloud_errors: int = 0


class EdgeServer:
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
        self.context = context or zmq.Context.instance()
        self.ledger = RequestLedger(ttl_s=config.result_ttl_s)
        self.executions = ExecutionLog(config.execution_log)
        self.counters = EdgeCounters()
        self.live: dict[str, EdgeRequest] = {}
        self.mailbox = Mailbox()  # the preparing thread's, the local worker's and the cloud link's events
        self._preparer: Preparer[Prepared] = Preparer("edged-prepare", self.mailbox)
        self._stop = threading.Event()
        self._draining = False
        self.socket = router_socket(self.context)
        self.endpoints = [self._bind(ep) for ep in config.endpoints]

    def _bind(self, endpoint: str) -> str:
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            port = self.socket.bind_to_random_port(endpoint.rsplit(":", 1)[0])
            return f"{endpoint.rsplit(':', 1)[0]}:{port}"
        self.socket.bind(endpoint)
        return endpoint

    # --- loop ------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Drain and return from ``serve_forever`` (safe from any thread or signal handler)."""
        self._stop.set()
        self.mailbox.wake()

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.mailbox.fd, zmq.POLLIN)
        grace_ends: float | None = None
        try:
            while True:
                if self._stop.is_set() and grace_ends is None:
                    self._draining = True
                    grace_ends = time.monotonic() + self.config.shutdown_grace_s
                if grace_ends is not None and (not (self.live or self._preparer) or time.monotonic() >= grace_ends):
                    for pending in self._preparer.drain():
                        self._reject_all(pending, Error(ErrorCode.REJECTED, "edged is shutting down",
                                                        pending.msg.request_id))
                    for req in list(self.live.values()):
                        self._cancel(req)
                    self.mailbox.run(wait_s=1.0, until=lambda: not self.live)  # their results
                    return
                events = dict(poller.poll(self._poll_ms()))
                if self.mailbox.fd in events:
                    self.mailbox.run()
                if self.socket in events:
                    self._read_all()
                self._check_timers()
                self.ledger.expire(time.monotonic())
        finally:
            self._preparer.close()
            self.worker.stop()
            if self.cloud is not None:
                self.cloud.close()
            self.socket.close()
            self.executions.close()
            self.mailbox.close()

    def _poll_ms(self) -> int:
        timers = [r.cloud_give_up for r in self.live.values() if r.cloud_waiting and r.cloud_give_up]
        if not timers:
            return 100
        return max(0, min(100, int((min(timers) - time.monotonic()) * 1000) + 1))

    def _read_all(self) -> None:
        for identity, _, _, msg in incoming(self.socket):
            try:
                if isinstance(msg, Error):
                    self._send(identity, msg)
                else:
                    self._handle(identity, msg)
            except ProtocolError as e:
                self._send(identity, Error(e.code, e.message, e.request_id))
            except Exception as e:  # a bug answering one message must not stop the daemon
                log.exception("failed to handle a message")
                self._send(identity, Error(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"))

    def _handle(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, Health):
            self._send(identity, Health("draining" if self._draining else "ok"))
        elif isinstance(msg, Stats):
            self._send(identity, Stats(self.snapshot()))
        elif isinstance(msg, Cancel):
            self._on_cancel(identity, msg)
        elif isinstance(msg, Generate):
            self._on_generate(identity, msg)
        else:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{msg.TYPE!r} is a reply, not a request",
                                getattr(msg, "request_id", None))

    # --- admission -----------------------------------------------------------------------------

    def _on_generate(self, identity: bytes, msg: Generate) -> None:
        """Cheap checks here; tokenizing and grammar validation on the preparing thread, so health
        and every other message are answered meanwhile; ``_admit`` takes it from there. A retry
        while its request is being prepared joins it."""
        rid = msg.request_id
        entry = self.ledger.get(rid)
        if entry is not None:
            for reply in entry.rejoin(identity, msg):
                self._send(identity, reply)
            return
        joined = self._preparer.rejoin(identity, msg)
        if joined is not None:
            for reply in joined:
                self._send(identity, reply)
            return
        self.counters.requests += 1
        if self._draining:
            return self._reject(identity, Error(ErrorCode.REJECTED, "edged is shutting down", rid))
        if self.worker.depth >= self.config.max_queue:
            return self._reject(identity, Error(ErrorCode.REJECTED,
                                                f"overloaded: {self.config.max_queue} local jobs queued", rid))
        chars = sum(len(m.content) for m in msg.messages)
        if chars > self.config.max_prompt_chars:
            return self._reject(identity, Error(ErrorCode.INVALID_REQUEST, f"prompt of {chars} characters is over "
                                                f"max_prompt_chars {self.config.max_prompt_chars}", rid))
        self._preparer.start(identity, msg, functools.partial(self._prepare, msg), self._admit)

    def _prepare(self, msg: Generate) -> Prepared:
        """The preparing thread: ValueError for a request that cannot be served."""
        prompt = (self.tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in msg.messages])
                  if msg.messages else list(msg.prompt_ids))
        spec = grammar_spec(msg.response_format)
        params = SamplingParams.from_wire(msg.sampling)
        if spec is not None:
            self.compiler.validate(spec)
        return Prepared(prompt, params, spec)

    def _admit(self, pending: Admitting, done: Future[Prepared]) -> None:
        msg, first, rid = pending.msg, pending.identities[0], pending.msg.request_id
        try:
            prepared = done.result()
        except ValueError as e:
            return self._reject_all(pending, Error(ErrorCode.INVALID_REQUEST, str(e), rid))
        except Exception as e:  # a bug preparing one request must not stop the daemon
            log.exception("failed to prepare a request")
            return self._reject_all(pending, Error(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}", rid))
        if pending.cancelled_by:
            return self._reject_all(pending, Result(rid, "", FinishReason.ABORT.value, Usage(len(prepared.prompt_ids), 0),
                                                    source=Source.EDGE, detail="cancelled"))
        prompt, params = prepared.prompt_ids, prepared.params
        deadline = None if msg.deadline_ms is None else pending.received + msg.deadline_ms / 1000
        req = EdgeRequest(msg, self.ledger.open(msg, first), pending.received, prompt, prepared.spec, deadline)
        for identity in pending.identities[1:]:
            req.entry.subscribe(identity)
        own_s = self.worker.rate.seconds(len(prompt), params.max_tokens)
        wait_s = self.worker.wait_estimate_s(msg.priority.rank, deadline, own_s)
        req.reason = self.policy.before(msg, len(prompt), wait_s)
        if req.reason is EscalationReason.CONTEXT and (self.cloud is None or msg.escalation.value == "local"):
            self.ledger.discard(rid)
            return self._reject_all(pending, Error(
                ErrorCode.INVALID_REQUEST,
                f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} does not fit the robot's "
                f"context of {self.policy.local_context} and "
                f"{'no cloud is configured' if self.cloud is None else 'the request is forced local'}", rid))
        self.live[rid] = req
        self.executions.started(rid)
        if req.reason is not EscalationReason.CONTEXT:
            self._start_local(req, params)
        if req.reason is not None:
            self._escalate(req)

    def _reject_all(self, pending: Admitting, reply: Error | Result) -> None:
        """Answer a request that never ran: its senders, and those who cancelled it meanwhile."""
        self.counters.rejected += isinstance(reply, Error)
        for identity in pending.everyone:
            self._send(identity, reply)

    def _reject(self, identity: bytes, error: Error) -> None:
        self.counters.rejected += 1
        self._send(identity, error)

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
        req.local_done = True
        job = req.local.job
        if req.reason is None and job.error is None:
            reason = self.policy.after(req.msg, job, req.spec)
            if reason is not None:
                req.reason = reason
                self._escalate(req)
                return
        self._settle(req)

    # --- cloud ---------------------------------------------------------------------------------

    def _escalate(self, req: EdgeRequest) -> None:
        reason = req.reason.value
        self.counters.escalations[reason] = self.counters.escalations.get(reason, 0) + 1
        if self.cloud is None:
            req.cloud_error = "no cloud is configured"
        elif not self.cloud.breaker.allow():
            req.cloud_error = "the cloud link's circuit breaker is open"
        else:
            now = time.monotonic()
            req.cloud_started = now
            margin = self.cloud.config.fallback_margin_ms / 1000
            req.cloud_give_up = (req.deadline - margin) if req.deadline is not None else \
                now + self.cloud.config.cloud_timeout_s
            remaining_ms = None if req.deadline is None else max(1, int((req.deadline - now) * 1000))
            rid = req.msg.request_id
            self.cloud.submit(
                req.msg, robot_id=self.config.robot_id, deadline_ms=remaining_ms,
                on_result=lambda result: self.mailbox.post(lambda: self._on_cloud_result(rid, result)),
                on_error=lambda error: self.mailbox.post(lambda: self._on_cloud_error(rid, error)),
            )
            return
        self._settle(req)

    def _on_cloud_result(self, rid: str, result: Result) -> None:
        req = self.live.get(rid)
        if req is None or not req.cloud_waiting:
            return
        req.cloud_result = result
        self._settle(req)

    def _on_cloud_error(self, rid: str, error: Error) -> None:
        req = self.live.get(rid)
        self.counters.cloud_errors += 1
        if req is None or not req.cloud_waiting:
            return
        req.cloud_error = f"cloud {error.code.value}: {error.message}"
        self._settle(req)

    def _check_timers(self) -> None:
        now = time.monotonic()
        for req in list(self.live.values()):
            if req.cloud_waiting and req.cloud_give_up is not None and now >= req.cloud_give_up:
                req.cloud_error = "the cloud did not answer in time"
                self.cloud.abandon(req.msg.request_id)
                self._settle(req)

    # --- answers -------------------------------------------------------------------------------

    def _settle(self, req: EdgeRequest) -> None:
        """Answer ``req`` if its answer is known: the cloud's, else the local one once the cloud
        is out of the picture. Otherwise keep waiting."""
        if req.cloud_result is not None:
            if req.local is not None and not req.local_done:
                self.worker.cancel(req.msg.request_id)
            return self._answer(req, self._from_cloud(req, req.cloud_result))
        if req.cloud_waiting:
            return
        if req.local is None:  # the prompt only fits the cloud, and the cloud failed
            self._finish(req, Error(ErrorCode.UNAVAILABLE, f"escalation needed ({req.reason.value}) and "
                                    f"{req.cloud_error}", req.msg.request_id))
            return
        if not req.local_done:
            return
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
            details.append(f"escalated ({req.reason.value}) but {req.cloud_error}: this is the robot's own plan")
        if job.finish_reason is FinishReason.DEADLINE:
            details.append("the deadline passed: the text is what was generated by then")
        return Result(
            request_id=req.msg.request_id, text=job.text, finish_reason=job.finish_reason.value,
            usage=Usage(len(job.prompt_ids), len(job.generated), job.reused_tokens),
            token_ids=tuple(job.generated), source=Source.EDGE,
            plan=_plan(job.text, req.spec), degraded=degraded,
            escalation_reason=req.reason.value if req.reason else None, timings=timings,
            detail="; ".join(details) or None,
        )

    def _from_cloud(self, req: EdgeRequest, cloud: Result) -> Result:
        timings = {f"cloud_{k}": v for k, v in cloud.timings.items()}
        timings["e2e_s"] = time.monotonic() - req.received
        timings["cloud_s"] = time.monotonic() - req.cloud_started
        return replace(cloud, request_id=req.msg.request_id, source=Source.CLOUD, degraded=False,
                       plan=cloud.plan if cloud.plan is not None else _plan(cloud.text, req.spec),
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
        rid = req.msg.request_id
        self.live.pop(rid, None)
        self.executions.ended(rid, reply.finish_reason if isinstance(reply, Result) else reply.code.value)
        if isinstance(reply, Result):
            self.ledger.close(rid, reply, time.monotonic())
        else:
            self.ledger.discard(rid)
        for identity in req.entry.subscribers:
            self._send(identity, reply)

    def _chunk(self, req: EdgeRequest, tokens: list[int], text: str, source: Source) -> None:
        chunk = Chunk(req.msg.request_id, req.entry.next_seq, tuple(tokens), text, source)
        req.entry.chunks.append(chunk)
        for identity in req.entry.subscribers:
            self._send(identity, chunk)

    # --- cancel, stats ---------------------------------------------------------------------------

    def _on_cancel(self, identity: bytes, msg: Cancel) -> None:
        if self._preparer.cancel(msg.request_id, identity):  # answered (abort) once it is prepared
            return
        reply = self.ledger.cancel(msg.request_id, identity)
        if reply is not None:
            self._send(identity, reply)
        else:
            self._cancel(self.live[msg.request_id])

    def _cancel(self, req: EdgeRequest) -> None:
        """End ``req`` as cancelled: its local job stops (its result, finish reason ``abort``,
        follows); a cloud call is abandoned."""
        if req.cloud_waiting:
            self.cloud.abandon(req.msg.request_id)
            req.cloud_error = "cancelled"
        if req.local is not None and not req.local_done:
            req.reason = None  # a cancelled request is answered as it stands, not escalated
            self.worker.cancel(req.msg.request_id)
        elif req.local is None:  # only the cloud had it: nothing was generated here
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
            "draining": self._draining, "live": len(self.live), "local_queue": self.worker.depth,
            "requests": c.requests, "answered_local": c.answered_local, "answered_cloud": c.answered_cloud,
            "fallbacks": c.fallbacks, "rejected": c.rejected, "escalations": dict(c.escalations),
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

    def _send(self, identity: bytes, msg: Message) -> None:
        send_nowait(self.socket, identity, encode(msg))


def _plan(text: str, spec: GrammarSpec | None):
    value = parse_structured(text, spec) if spec is not None else None
    return value if isinstance(value, dict) else None

