"""cloudd's core: an engine thread that owns the engine, behind a front thread that owns the
ZeroMQ ROUTER socket.

The front thread decodes every incoming message: it answers ``health`` itself at once (so a
client's heartbeat is answered even while a long engine step runs) and every malformed message
with an ``error``, and passes the rest to the engine thread over an ``inproc`` pair; it relays
the engine thread's replies back to their clients. Each turn of the engine loop reads every
message waiting and answers it, admits the ``generate`` requests the preparing thread has
tokenized and checked (``Engine.prepare``, ``shared.transport.preparing``: a long prompt or a
new grammar never holds the steps), runs one engine step if there is work, and sends each delta
to the requests' subscribers. Nothing else touches the engine's state (``prepare`` reads only
the tokenizer, the model's config and the grammar compiler), so it needs no lock. The HTTP
front end (``cloudd.http_api``) is a protocol client of this server over ``inproc``.

Bad input never stops the loop: undecodable bytes, wrong versions, unknown types, bad field
values and unservable requests all get an ``error`` reply with a code; the message that caused
it changes nothing. ``stop()`` (or SIGTERM/SIGINT in ``cloudd serve``) drains: new requests
are rejected, running ones get ``shutdown_grace_s`` to finish, the rest are cancelled with a
``result`` (finish reason ``abort``) so every client hears how its request ended.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace

import zmq

from cloudd.metrics import ServerMetrics
from cloudd.quota import QuotaConfig, RobotQuotas
from cloudd.monitor import FleetMonitor, RequestRecord, robot_view
from shared.engine.engine import DeadlineUnmeetable, Engine, PreparedPrompt, TokenDelta
from shared.engine.request import FinishReason, Request
from shared.engine.sampling_params import SamplingParams
from shared.model.summary import ModelSummary
from shared.protocol.codec import ProtocolError, decode, encode
from shared.protocol.messages import (
    Cancel,
    Chunk,
    Error,
    ErrorCode,
    Generate,
    Health,
    Message,
    Result,
    Source,
    Stats,
    Usage,
)
from shared.transport.curve import OPERATOR, Caller, ClientCurve, ServerCurve
from shared.transport.execution_log import ExecutionLog
from shared.transport.ledger import LedgerEntry, RequestLedger
from shared.transport.loopback import is_loopback
from shared.transport.mailbox import Mailbox
from shared.transport.preparing import Admitting, Preparer
from shared.transport.router import incoming, relay_replies, router_socket, send_nowait, thread_pipe

log = logging.getLogger(__name__)
# A generate frame up to this size is prepared on the engine's thread: at most about a millisecond
# of tokenizing (0.27 ms a KB here) and a few of a new grammar's check; larger ones on the
# preparing thread, so that they neither hold the steps nor queue the small ones behind them.
PREPARE_HERE_BYTES = 4096


@dataclass(frozen=True)
class ServeConfig:
    """The ``[serve]`` table of cloudd's config."""

    zmq_host: str = "127.0.0.1"
    zmq_port: int = 5555
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    result_ttl_s: float = 300.0  # finished results kept for retries with the same request_id
    max_waiting: int = 4096  # more waiting requests than this: new ones are rejected (overload)
    shutdown_grace_s: float = 30.0  # on stop, running requests get this long to finish
    idle_poll_ms: int = 50  # how long the loop sleeps on the socket when the engine is idle
    max_robot_labels: int = 64  # Prometheus robot label series kept (the robots seen last)
    http_timeout_s: float = 30.0  # an HTTP connection silent this long is closed
    stall_after_s: float = 10.0  # an engine turn running longer: health answers "stalled"
    http_max_connections: int = 256  # more open at once: the next is answered 503
    # per-robot limits (cloudd.quota); 0 = unlimited
    robot_requests_per_s: float = 0.0
    robot_burst: int = 20
    robot_tokens_per_min: float = 0.0
    # per sender (its CURVE key, else its connection): frames past this rate are dropped unread
    frames_per_s: float = 0.0
    frames_burst: int = 200
    # response_format objects (JSON files) or "fleet-plan" to compile at start-up
    precompile: tuple[str, ...] = ()
    # CURVE: both set = every connection is encrypted and must present a robot key found in
    # curve_authorized_dir or an operator key in curve_operator_dir (see shared.transport.curve);
    # both empty = plain TCP on loopback.
    curve_secret_key: str = ""
    curve_authorized_dir: str = ""
    # With CURVE: the public keys of operators (fleetctl): they see and stop every robot's requests
    curve_operator_dir: str = ""
    # the HTTP API's keys (cloudd.api_keys; `cloudd api-key NAME --file F` makes one): set, every
    # route needs a bearer token (/health and /metrics stay open on loopback) and http_host may
    # be beyond loopback
    http_api_keys: str = ""
    # a journal of every execution (shared.transport.execution_log): "" = none
    execution_log: str = ""

    def __post_init__(self) -> None:
        for name in ("zmq_port", "http_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be a port number, got {getattr(self, name)}")
        if self.result_ttl_s <= 0 or self.max_waiting < 1 or self.shutdown_grace_s < 0 or self.idle_poll_ms < 1:
            raise ValueError("result_ttl_s > 0, max_waiting >= 1, shutdown_grace_s >= 0, idle_poll_ms >= 1")
        if self.http_timeout_s <= 0 or self.http_max_connections < 1 or self.stall_after_s <= 0:
            raise ValueError("http_timeout_s > 0, http_max_connections >= 1, stall_after_s > 0")
        if bool(self.curve_secret_key) != bool(self.curve_authorized_dir):
            raise ValueError("curve_secret_key and curve_authorized_dir go together")
        if self.curve_operator_dir and not self.curve_secret_key:
            raise ValueError("curve_operator_dir needs CURVE on (curve_secret_key, curve_authorized_dir)")
        if not self.curve_secret_key and not is_loopback(self.zmq_host):
            raise ValueError(f"zmq_host {self.zmq_host!r} is not loopback: set curve_secret_key and "
                             "curve_authorized_dir, so that only the fleet's keys get in")
        if not is_loopback(self.http_host) and not self.http_api_keys:
            raise ValueError(f"http_host {self.http_host!r} is not loopback: set http_api_keys, so that only "
                             "holders of the fleet's API keys get in")


class CloudServer:
    def __init__(self, engine: Engine, config: ServeConfig, model_name: str, context: zmq.Context | None = None):
        self.engine = engine
        self.config = config
        self.model_name = model_name
        self.context = context or zmq.Context.instance()
        self.ledger = RequestLedger(ttl_s=config.result_ttl_s)
        self.executions = ExecutionLog(config.execution_log)
        self.monitor = FleetMonitor(model_name, engine.scheduler.policy.name,
                                    model_summary=ModelSummary.of(model_name, engine.runner.model.config))
        self.metrics = ServerMetrics(config.max_robot_labels)
        self.quotas = RobotQuotas(QuotaConfig(config.robot_requests_per_s, config.robot_burst,
                                              config.robot_tokens_per_min))
        # the front thread's: one bucket of frames per sender
        self._frame_quota = RobotQuotas(QuotaConfig(requests_per_s=config.frames_per_s, burst=config.frames_burst))
        self._requests: dict[str, Request] = {}  # live engine requests by id (for results)
        self.mailbox = Mailbox()  # the preparing thread's outcomes, for the engine's thread
        self._preparer: Preparer[PreparedPrompt] = Preparer("cloudd-prepare", self.mailbox)
        self._stop = threading.Event()
        self._draining = False
        self._turn_began: float | None = None  # when the engine thread's current turn began (None: idle)
        self.socket = router_socket(self.context)  # the front thread's, once serving
        self.curve: ServerCurve | None = None
        self.local_curve: ClientCurve | None = None  # what a client in this process connects with
        if config.curve_secret_key:
            self.curve = ServerCurve(self.context, config.curve_secret_key, config.curve_authorized_dir,
                                     config.curve_operator_dir or None)
            self.curve.apply(self.socket)
            self.local_curve = self.curve.local_client()
        self.inproc_endpoint = f"inproc://cloudd-{id(self):x}"  # for clients in this process (HTTP)
        self.socket.bind(self.inproc_endpoint)
        self.endpoint = self._bind_tcp()
        self._front_pipe, self._engine_pipe = thread_pipe(self.context, f"cloudd-pipe-{id(self):x}")
        self._front_done = threading.Event()

    def _bind_tcp(self) -> str:
        c = self.config
        if c.zmq_port == 0:
            port = self.socket.bind_to_random_port(f"tcp://{c.zmq_host}")
        else:
            port = c.zmq_port
            self.socket.bind(f"tcp://{c.zmq_host}:{port}")
        return f"tcp://{c.zmq_host}:{port}"

    # --- the loop -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the loop to drain and return (safe from any thread or a signal handler)."""
        self._stop.set()

    def serve_forever(self) -> None:
        """Run until ``stop()``, then drain; closes the sockets on return."""
        front = threading.Thread(target=self._front, name="cloudd-front", daemon=True)
        front.start()
        poller = zmq.Poller()
        poller.register(self._engine_pipe, zmq.POLLIN)
        poller.register(self.mailbox.fd, zmq.POLLIN)
        grace_ends: float | None = None
        try:
            while True:
                if self._stop.is_set() and grace_ends is None:
                    self._draining = True
                    grace_ends = time.monotonic() + self.config.shutdown_grace_s
                    log.info("draining: %d requests live", len(self._requests))
                if grace_ends is not None and (not (self._requests or self._preparer)
                                               or time.monotonic() >= grace_ends):
                    for pending in self._preparer.drain():
                        self._answer_unstarted(pending, Error(ErrorCode.REJECTED, "server shutting down",
                                                              pending.msg.request_id))
                    self._cancel_all("server shutting down")
                    return
                busy = self.engine.has_unfinished
                events = dict(poller.poll(0 if busy else self.config.idle_poll_ms))
                self._turn_began = time.monotonic()
                if self.mailbox.fd in events:
                    self.mailbox.run()
                if self._engine_pipe in events:
                    self._read_all()
                if self.engine.has_unfinished:
                    self._step()
                self.ledger.expire(time.monotonic())
                self._turn_began = None
        finally:
            self._front_done.set()
            front.join()
            self._engine_pipe.close()
            self._preparer.close()
            self.mailbox.close()
            self.executions.close()

    def _front(self) -> None:
        """The front thread: client messages in (health and errors answered here), replies out."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._front_pipe, zmq.POLLIN)
        try:
            while not self._front_done.is_set():
                events = dict(poller.poll(100))
                if self._front_pipe in events:
                    relay_replies(self._front_pipe, self.socket)
                if self.socket in events:
                    self._triage()
            relay_replies(self._front_pipe, self.socket)  # the engine's last words
        finally:
            self._front_pipe.close()
            self.socket.close()
            if self.curve is not None:
                self.curve.stop()

    def _triage(self) -> None:
        """Read waiting client messages: answer bad ones and health here, pass the rest on."""
        for identity, user_id, payload, msg in incoming(self.socket):
            if self._frame_quota.config.enabled and self._frame_quota.charge(user_id or identity.hex(), 0) > 0:
                self.metrics.frames_dropped.inc()  # a flood: answering it would double it
            elif user_id is not None and self.curve is not None and not self.curve.allows(user_id):
                self._send_now(identity, encode(Error(ErrorCode.UNAVAILABLE, "this client's CURVE key is no longer "
                                                      "authorized", getattr(msg, "request_id", None))))
            elif isinstance(msg, Error):
                self._send_now(identity, encode(msg))
            elif isinstance(msg, Health):
                self._send_now(identity, encode(Health(self.health())))
            else:
                self._front_pipe.send_multipart([identity, (user_id or "").encode(), payload])

    def reload_keys(self) -> None:
        """Read the CURVE key directories again (SIGHUP): live streams go on; a removed key's
        next message is refused, a new key can connect."""
        if self.curve is None:
            log.info("SIGHUP: CURVE is off, no keys to reload")
            return
        try:
            robots, operators = self.curve.reload()
        except (OSError, ValueError) as e:  # a directory gone, a bad key file: keep the keys in force
            log.error("SIGHUP: keys not reloaded, the previous ones stay in force: %s", e)
            return
        log.info("SIGHUP: keys reloaded: %d robots, %d operators", robots, operators)

    def health(self) -> str:
        """``draining`` once stopping; ``stalled`` while one engine turn (reading requests, a
        step) has run past ``stall_after_s``, as a grammar, a validation or a bug can make it;
        else ``ok``. Answered by the front thread, so it answers during a stall."""
        began = self._turn_began
        if self._draining:
            return "draining"
        if began is not None and time.monotonic() - began > self.config.stall_after_s:
            return "stalled"
        return "ok"

    def _send_now(self, identity: bytes, payload: bytes) -> None:
        """Front thread only."""
        send_nowait(self.socket, identity, payload)

    def _read_all(self, limit: int = 1000) -> None:
        """Engine thread: handle the messages the front thread passed on (all decodable)."""
        for _ in range(limit):
            try:
                identity, user_id, payload = self._engine_pipe.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                caller = self.curve.identify(user_id.decode() or None) if self.curve is not None else OPERATOR
                self._handle(identity, caller, decode(payload), len(payload))
            except ProtocolError as e:
                self._send(identity, Error(e.code, e.message, e.request_id))
            except Exception as e:  # a bug must not take the fleet's server down
                log.exception("internal error handling a message")
                self._send(identity, Error(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}"))

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
        except Exception:  # the scheduler itself failed (a request's own failure ends it alone)
            log.exception("engine step failed: cancelling every live request")
            self._cancel_all("internal error in the engine", ErrorCode.INTERNAL)
            return
        for delta in deltas:
            self._publish(delta)
        self.metrics.on_engine(self.engine.stats())

    # --- requests ----------------------------------------------------------------------------

    def _handle(self, identity: bytes, caller: Caller, msg: Message, size: int) -> None:
        """With CURVE on, a robot acts as itself: its request ids start with its key's name and
        "/" (no robot can take an id another robot will use), its requests carry that name as
        ``robot_id`` whatever they claim (its fairness share and metrics are its own), it may
        cancel only its own requests (another robot's do not exist for it: ``not_found``), and
        its ``stats`` show only its own requests. Operators see and stop everything."""
        if isinstance(msg, Generate):
            if caller.robot is not None:
                if not msg.request_id.startswith(caller.robot + "/"):
                    raise ProtocolError(ErrorCode.INVALID_REQUEST, f"request_id {msg.request_id!r}: robot "
                                        f"{caller.robot!r}'s request ids start with '{caller.robot}/'", msg.request_id)
                msg = replace(msg, robot_id=caller.robot)
            self._on_generate(identity, msg, size)
        elif isinstance(msg, Cancel):
            self._on_cancel(identity, caller, msg)
        elif isinstance(msg, Stats):
            snapshot = self.snapshot()
            self._send(identity, Stats(snapshot if caller.robot is None else robot_view(snapshot, caller.robot)))
        else:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{msg.TYPE!r} is a reply, not a request",
                                getattr(msg, "request_id", None))

    def _on_generate(self, identity: bytes, msg: Generate, size: int) -> None:
        """Cheap checks here; tokenizing and the grammar's checks here too for a small request
        (``size``: its frame's bytes), else on the preparing thread; then ``_admit``. A retry of
        a request already known joins it (running, finished or being prepared)."""
        entry = self.ledger.get(msg.request_id)
        joined = entry.rejoin(identity, msg) if entry is not None else self._preparer.rejoin(identity, msg)
        if joined is not None:
            for reply in joined:
                self._send(identity, reply)
            return
        reject = self._admission_error(msg)
        if reject is not None:
            self._reject(identity, msg, reject)
            return
        try:
            params = SamplingParams.from_wire(msg.sampling)
        except ValueError as e:
            self._reject(identity, msg, Error(ErrorCode.INVALID_REQUEST, str(e), msg.request_id))
            return
        prompt = [{"role": m.role, "content": m.content} for m in msg.messages] or list(msg.prompt_ids)
        self._preparer.start(identity, msg, functools.partial(self.engine.prepare, prompt, msg.response_format),
                             functools.partial(self._admit, params), here=size <= PREPARE_HERE_BYTES)

    def _admit(self, params: SamplingParams, pending: Admitting, done: Future[PreparedPrompt]) -> None:
        """Engine thread: queue a prepared request in the engine, or answer why it never runs."""
        msg, rid = pending.msg, pending.msg.request_id
        try:
            prepared = done.result()
        except ValueError as e:
            return self._answer_unstarted(pending, Error(ErrorCode.INVALID_REQUEST, str(e), rid))
        except Exception as e:  # a bug preparing one request must not take the server down
            log.exception("failed to prepare a request")
            return self._answer_unstarted(pending, Error(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}", rid))
        if pending.cancelled_by:
            return self._answer_unstarted(pending, Result(rid, "", FinishReason.ABORT.value,
                                                          Usage(len(prepared.token_ids), 0), detail="cancelled"))
        deadline_s = pending.deadline_left_s()  # it counts from the request's arrival
        if deadline_s is not None and deadline_s <= 0:
            return self._answer_unstarted(pending, Error(ErrorCode.DEADLINE, "the deadline passed while the prompt "
                                                         "was being prepared", rid))
        try:
            self.engine.submit(prepared, params, rid, buffered=False, priority=msg.priority, robot_id=msg.robot_id,
                               deadline_s=deadline_s, resume_token_ids=msg.resume_token_ids)
        except DeadlineUnmeetable as e:
            return self._answer_unstarted(pending, Error(ErrorCode.DEADLINE, str(e), rid))
        except ValueError as e:
            return self._answer_unstarted(pending, Error(ErrorCode.INVALID_REQUEST, str(e), rid))
        self._requests[rid] = self.engine.get_request(rid)
        entry = self.ledger.open(msg, pending.identities[0])
        for identity in pending.identities[1:]:
            entry.subscribe(identity)
        self.executions.started(rid)
        self.monitor.on_submit(msg.robot_id)

    def _answer_unstarted(self, pending: Admitting, reply: Error | Result) -> None:
        """Answer a request that never ran: its senders, and those who cancelled it meanwhile."""
        first, *rest = pending.everyone
        if isinstance(reply, Error):
            self._reject(first, pending.msg, reply)
        else:
            self._send(first, reply)
        for identity in rest:
            self._send(identity, reply)

    def _admission_error(self, msg: Generate) -> Error | None:
        if self._draining:
            return Error(ErrorCode.REJECTED, "server is shutting down", msg.request_id)
        queued = self.engine.scheduler
        if len(queued.waiting) + len(queued.awaiting_grammar) + len(self._preparer) >= self.config.max_waiting:
            return Error(ErrorCode.REJECTED, f"overloaded: {self.config.max_waiting} requests waiting", msg.request_id)
        if self.quotas.config.enabled and (wait := self.quotas.charge(msg.robot_id, msg.sampling.max_tokens)) > 0:
            if math.isinf(wait):
                return Error(ErrorCode.INVALID_REQUEST, f"quota: max_tokens {msg.sampling.max_tokens} is more than "
                             f"robot {msg.robot_id!r} may use in a minute", msg.request_id)
            return Error(ErrorCode.REJECTED, f"quota: robot {msg.robot_id!r} is over its rate; retry after "
                         f"{wait:.1f} s", msg.request_id, retry_after_ms=math.ceil(wait * 1000))
        return None

    def _reject(self, identity: bytes, msg: Generate, error: Error) -> None:
        self.monitor.on_reject()
        self.metrics.on_reject(msg.priority.value, error.code.value)
        self._send(identity, error)

    def _on_cancel(self, identity: bytes, caller: Caller, msg: Cancel) -> None:
        if self._preparer.cancel(msg.request_id, identity, caller.robot):  # answered (abort) once prepared
            return
        reply = self.ledger.cancel(msg.request_id, identity, caller.robot)
        if reply is not None:
            self._send(identity, reply)
        else:  # the abort's result goes to every subscriber, the canceller among them
            self._publish(self.engine.abort(msg.request_id))

    def _publish(self, delta: TokenDelta) -> None:
        entry = self.ledger.live.get(delta.request_id)
        if entry is None:
            return
        entry.text.append(delta.text)
        entry.token_ids.extend(delta.token_ids)
        self.monitor.on_tokens(len(delta.token_ids))
        if entry.stream and (delta.token_ids or delta.text):
            chunk = Chunk(delta.request_id, entry.next_seq, tuple(delta.token_ids), delta.text)
            entry.chunks.append(chunk)
            for identity in entry.subscribers:
                self._send(identity, chunk)
        if delta.finished:
            self._finish(entry, self._requests.pop(delta.request_id))

    def _finish(self, entry: LedgerEntry, req: Request) -> None:
        """Send ``req``'s result; one that failed in the engine (finish reason ``error``) is
        answered ``internal`` instead, and forgotten, so that a retry runs it again."""
        record = RequestRecord.of(req, self.monitor.clock())
        self.monitor.on_finish(record)
        self.metrics.on_finish(record)
        if req.finish_reason is FinishReason.ERROR:
            self._fail_live(entry, Error(ErrorCode.INTERNAL, "internal error serving this request (cloudd's log "
                                         "has the trace); the fleet's other requests go on", req.request_id))
            return
        result = Result(
            request_id=req.request_id,
            text="".join(entry.text),
            finish_reason=record.finish_reason,
            usage=Usage(req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens),
            token_ids=tuple(entry.token_ids),
            source=Source.CLOUD,
            timings=record.timings(),
            detail=_detail(req),
        )
        self.ledger.close(req.request_id, result, time.monotonic())
        self.executions.ended(req.request_id, result.finish_reason)
        for identity in entry.subscribers:
            self._send(identity, result)

    def _cancel_all(self, why: str, code: ErrorCode | None = None) -> None:
        """End every live request: with an ``error`` of ``code``, or as cancelled (``abort``)."""
        for rid in list(self._requests):
            entry = self.ledger.live[rid]
            if code is not None:
                self.engine.abort(rid)
                self._requests.pop(rid)
                self._fail_live(entry, Error(code, why, rid))
                continue
            delta = self.engine.abort(rid)
            if delta is not None:
                self._publish(delta)
        log.info("cancelled live requests: %s", why)

    def _fail_live(self, entry: LedgerEntry, error: Error) -> None:
        """Answer a live request's subscribers with ``error`` and forget it (no result is kept:
        a retry under its id runs it anew)."""
        self.ledger.discard(error.request_id)
        self.executions.ended(error.request_id, error.code.value)
        for identity in entry.subscribers:
            self._send(identity, error)

    def snapshot(self) -> dict:
        """The ``stats`` reply (see ``cloudd.monitor``), with ``kv_check``: while the engine is
        idle, "ok" when every KV block is free or held by the prefix cache alone and the cache's
        structures agree (else what is wrong); "busy" while requests run."""
        snapshot = self.monitor.snapshot(self.engine.stats(), self._requests.values(), self._draining,
                                         self.engine.clock())
        return {**snapshot, "kv_check": self._kv_check()}

    def _kv_check(self) -> str:
        if self.engine.has_unfinished:
            return "busy"
        try:
            self.engine.scheduler.kv.check_integrity([])
        except AssertionError as e:
            return f"failed: {e}"
        return "ok"

    def _send(self, identity: bytes, msg: Message) -> None:
        """Engine thread: hand a reply to the front thread."""
        self._engine_pipe.send_multipart([identity, encode(msg)])


def _detail(req: Request) -> str | None:
    """Words for an ending the finish reason alone does not explain."""
    if req.grammar is not None and not req.grammar.finished and req.finish_reason is FinishReason.LENGTH:
        return "max_tokens ran out before the response_format was complete: the text does not parse"
    if req.finish_reason is FinishReason.DEADLINE:
        return "the deadline passed: the text is what was generated by then"
    return None

