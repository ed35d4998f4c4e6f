"""The request lifecycle every daemon shares (cloudd, edged, the cluster's front): identity and
authorization, retry by id (``shared.transport.ledger``), preparing off the loop
(``shared.transport.preparing``), admission, cancel, fan-out of chunks and results, answering
every sender of a request that never ran, graceful shutdown. Each daemon supplies only where its
requests run: a ``Lane`` (cloudd: the engine; edged: the local lane and escalation; the cluster:
its replicas).

Threads: a ``SocketFront`` thread owns the ROUTER socket (health, bad frames, revoked keys and
floods answered there); everything else runs on the loop's thread, the one that calls
``serve_forever``, which owns the ledger and every request's state and runs the lane's work
between messages. Other threads (the preparing thread, the lane's workers) hand their outcomes
to the loop through ``mailbox``.

Admission (``_admission_error``, then ``_charge_tokens`` once prepared) checks, in this order:
draining; the request's priority against its identity's grant (``shared.transport.priority_grants``:
``forbidden``); the lane's refusal; the robot's share of requests in flight; its request rate;
once prepared, its prompt's tokens plus ``max_tokens`` against its token quota
(``shared.transport.quota``). Token ids longer than ``max_prompt_ids`` are refused as the frame
is decoded, on the socket's thread, before one Python int is made per id.

With CURVE on, a robot acts as itself: its request ids start with its key's name and "/" (no
robot can take an id another robot will use), its requests carry that name as ``robot_id``
whatever they claim (its fairness share, quota and metrics are its own), it may cancel only its
own requests (another robot's do not exist for it: ``not_found``), and the lane shows it only
its own requests in ``stats``. Operators see and stop everything.

Bad input never stops the loop: a bad field, an unservable request or a bug handling one
message gets an ``error`` reply with a code, and the message changes nothing. ``stop()`` drains:
new requests are rejected, running ones get ``shutdown_grace_s`` to finish, then requests being
prepared are rejected and the lane ends the rest (``Lane.cancel_all``), so every client hears
how its request ended.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

import zmq

from shared.protocol.codec import ProtocolError
from shared.protocol.messages import (
    MAX_PROMPT_IDS, Cancel, Chunk, Error, ErrorCode, Generate, Message, Result, Source, Stats,
)
from shared.transport.curve import OPERATOR, Caller, ServerCurve
from shared.transport.execution_log import ExecutionLog, KeptResult, read_kept_results
from shared.transport.ledger import LedgerEntry, RequestLedger
from shared.transport.mailbox import Mailbox
from shared.transport.preparing import Admitting, Preparer
from shared.transport.priority_grants import PriorityGrants
from shared.transport.quota import InFlight, QuotaConfig, RobotQuotas
from shared.transport.socket_front import Inbound, SocketFront

log = logging.getLogger(__name__)
P = TypeVar("P")
MESSAGES_PER_TURN = 1000  # the most events one turn of the loop runs before the lane's work


@dataclass(frozen=True)
class FrontConfig:
    """``daemon`` names the server in its replies ("cloudd is shutting down"); ``endpoints``
    are bound on one socket (``tcp://host:0``: a free port). CURVE: ``curve_secret_key`` and
    ``curve_authorized_dir`` both set encrypt every connection and admit only the robots' keys
    (and the operators' in ``curve_operator_dir``: see ``shared.transport.curve``)."""

    daemon: str
    endpoints: tuple[str, ...]
    result_ttl_s: float = 300.0  # finished results kept for retries with the same request_id
    shutdown_grace_s: float = 30.0  # on stop, running requests get this long to finish
    stall_after_s: float = 10.0  # one turn of the loop running longer: health answers "stalled"
    # a journal of every execution and its result (shared.transport.execution_log), where a restart
    # finds the results the process before it had not sent yet: "" = none
    execution_log: str = ""
    robot_quota: QuotaConfig = field(default_factory=QuotaConfig)  # per robot: on arrival, then tokens once prepared
    frame_quota: QuotaConfig = field(default_factory=QuotaConfig)  # per sender; frames past it are dropped unread
    robot_max_in_flight: int = 0  # requests one robot may have admitted and unanswered at once; 0: no cap
    priority_grants: PriorityGrants = field(default_factory=PriorityGrants)  # default: every class for everyone
    # prompt_ids / resume_token_ids longer than this are refused as the frame is decoded (cloudd: max_model_len)
    max_prompt_ids: int = MAX_PROMPT_IDS
    curve_secret_key: str = ""
    curve_authorized_dir: str = ""
    curve_operator_dir: str = ""


class Refused(Exception):
    """``Lane.start``'s answer to a request it will not run: ``reply`` goes to its senders."""

    def __init__(self, reply: Error):
        super().__init__(reply.message)
        self.reply = reply


class Lane(ABC, Generic[P]):
    """Where a daemon's requests run; called on the loop's thread (``prepare`` aside). The lane
    reports each running request's output through ``RequestFront.emit`` and its end through
    ``RequestFront.finish``, on the loop's thread (``mailbox.post`` from others). A daemon is a
    lane with its ``front`` (set by its constructor), run and stopped through it."""

    front: RequestFront[P]

    def serve_forever(self) -> None:
        """Run the front's loop until ``stop()``, then drain; closes the socket and the lane on return."""
        self.front.serve_forever()

    def stop(self) -> None:
        """Drain and return from ``serve_forever`` (safe from any thread or a signal handler)."""
        self.front.stop()

    def reload_keys(self) -> None:
        """SIGHUP: see ``RequestFront.reload_keys``."""
        self.front.reload_keys()

    @abstractmethod
    def refusal(self, msg: Generate) -> Error | None:
        """Why ``msg`` cannot be taken now (overloaded, too large), before any work; None: it can."""

    @abstractmethod
    def prepare(self, msg: Generate) -> P:
        """The preparing thread (or the loop's, see ``prepares_here``): tokenize, check. A
        ``ValueError`` is the request's fault (``invalid_request``)."""

    def prepares_here(self, size: int) -> bool:
        """Whether a request of a ``size``-byte frame is quick enough to prepare on the loop's
        thread, so that it does not queue behind a long one."""
        return False

    @abstractmethod
    def start(self, pending: Admitting, prepared: P) -> None:
        """Run a prepared request (its ledger entry is open); raise ``Refused`` to answer it instead."""

    @abstractmethod
    def cancelled_before_start(self, request_id: str, prepared: P) -> Result:
        """The result of a request cancelled while it was prepared (it never runs)."""

    @abstractmethod
    def cancel(self, request_id: str) -> None:
        """End a running request as cancelled; its result (finish reason ``abort``) follows."""

    @abstractmethod
    def cancel_all(self, why: str) -> None:
        """Shutting down: end every running request now, each with a reply."""

    @abstractmethod
    def stats(self, caller: Caller, reply: Callable[[dict | Error], None]) -> None:
        """The ``stats`` snapshot ``caller`` may see (or the error why there is none), given to
        ``reply`` on the loop's thread."""

    def wait_ms(self) -> int:
        """How long the loop may sleep for messages now (0: the lane has work waiting)."""
        return 100

    def work(self) -> None:
        """The lane's own work for one turn of the loop (an engine step, timers)."""

    def on_reject(self, msg: Generate, error: Error) -> None:
        """A request refused before it ran (for the daemon's metrics)."""

    def degraded(self) -> str | None:
        """Why the lane serves everyone slower now, naming the request at fault (one whose own
        work held a step past ``stall_after_s``), for ``health``; None when nothing is. Called
        on the socket's thread: it reads only what the loop replaces whole."""
        return None

    def close(self) -> None:
        """The loop has ended: release what the lane holds."""


@dataclass
class FrontCounters:
    requests: int = 0  # new requests (not retries) that arrived
    rejected: int = 0  # of which were answered with an error before they ran


class RequestFront(Generic[P]):
    """The lifecycle for ``lane``; ``endpoints`` holds the bound addresses once constructed.
    ``on_frame_dropped`` runs on the socket's thread for each frame past its sender's rate.
    ``prompt_tokens``: how many tokens a prepared request's prompt holds, for its quota (the
    default counts its ``prompt_ids``: a lane that tokenizes chat messages gives its own)."""

    def __init__(self, lane: Lane[P], config: FrontConfig, context: zmq.Context | None = None,
                 on_frame_dropped: Callable[[], None] = lambda: None,
                 prompt_tokens: Callable[[Generate, P], int] = lambda msg, _prepared: len(msg.prompt_ids)):
        self.lane = lane
        self.config = config
        self.context = context or zmq.Context.instance()
        self.ledger = RequestLedger(ttl_s=config.result_ttl_s)
        if config.execution_log:
            self._restore_results(config.execution_log)
        self.executions = ExecutionLog(config.execution_log)
        self.quotas = RobotQuotas(config.robot_quota)
        self.in_flight = InFlight(config.robot_max_in_flight)
        self._prompt_tokens = prompt_tokens
        self.counters = FrontCounters()
        self.mailbox = Mailbox()
        self.preparer: Preparer[P] = Preparer(f"{config.daemon}-prepare", self.mailbox)
        self.draining = False
        self._stop = threading.Event()
        self._turn_began: float | None = None  # when the loop's current turn began (None: idle)
        self.curve = (ServerCurve(self.context, config.curve_secret_key, config.curve_authorized_dir,
                                  config.curve_operator_dir or None) if config.curve_secret_key else None)
        self.socket_front = SocketFront(self.context, config.endpoints, self.curve,
                                  RobotQuotas(config.frame_quota), self.health, self._deliver, on_frame_dropped,
                                  max_prompt_ids=config.max_prompt_ids)
        self.endpoints = self.socket_front.endpoints

    # --- the loop ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Drain and return from ``serve_forever`` (safe from any thread or a signal handler)."""
        self._stop.set()
        self.mailbox.wake()

    def serve_forever(self) -> None:
        """Run until ``stop()``, then drain; closes the socket and the lane on return."""
        self.socket_front.start()
        poller = zmq.Poller()
        poller.register(self.mailbox.fd, zmq.POLLIN)
        grace_ends: float | None = None
        try:
            while True:
                if self._stop.is_set() and grace_ends is None:
                    self.draining = True
                    grace_ends = time.monotonic() + self.config.shutdown_grace_s
                    log.info("draining: %d requests live", len(self.ledger.live))
                if grace_ends is not None and (not (self.ledger.live or self.preparer)
                                               or time.monotonic() >= grace_ends):
                    return self._close_out()
                events = dict(poller.poll(self.lane.wait_ms()))
                self._turn_began = time.monotonic()
                if self.mailbox.fd in events:
                    self.mailbox.run(limit=MESSAGES_PER_TURN)
                self.lane.work()
                self.ledger.expire(time.monotonic())
                self._turn_began = None
        finally:
            self.socket_front.close()
            self.preparer.close()
            self.lane.close()
            self.executions.close()
            self.mailbox.close()

    def _close_out(self) -> None:
        why = f"{self.config.daemon} is shutting down"
        for pending in self.preparer.drain():
            self.answer_unstarted(pending, Error(ErrorCode.REJECTED, why, pending.msg.request_id))
        self.lane.cancel_all(why)

    def health(self) -> str:
        """``draining`` once stopping; ``stalled`` while one turn of the loop (reading requests,
        an engine step) has run past ``stall_after_s``, as a grammar, a validation or a bug can
        make it; ``degraded: <why>`` while the lane says one request made a step that slow
        (``Lane.degraded``: cloudd names it for a minute after); else ``ok``. Every answer but
        ``ok`` is unhealthy; readers that compare with "ok" need no change. Answered by the
        socket's thread, so it answers during a stall."""
        began = self._turn_began
        if self.draining:
            return "draining"
        if began is not None and time.monotonic() - began > self.config.stall_after_s:
            return "stalled"
        if (why := self.lane.degraded()) is not None:
            return f"degraded: {why}"
        return "ok"

    def check_integrity(self) -> None:
        """The loop's thread (or a test's, with the loop idle): every admitted request is being
        prepared or running until it is answered (``in_flight``: admit once, release once)."""
        held = Counter(e.robot_id for e in self.ledger.live.values())
        held.update(p.msg.robot_id for p in self.preparer.pending.values())
        self.in_flight.check_integrity(held)

    def _restore_results(self, journal: str) -> None:
        """The results kept in ``journal`` by the process before this one (a crash, a restart):
        a retry of a request that ended there is answered with its result, not run again."""
        wall, monotonic = time.time(), time.monotonic()
        kept = read_kept_results(journal, self.config.result_ttl_s, wall)
        for k in kept:
            self.ledger.keep(k, finished_at=monotonic - (wall - k.finished_at))
        if kept:
            log.info("%d results kept from before the restart (%s)", len(kept), journal)

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

    def _deliver(self, inbound: Inbound) -> None:
        """The socket's thread: hand a message to the loop."""
        self.mailbox.post(functools.partial(self._handle_safely, inbound))

    # --- messages (the loop's thread) ------------------------------------------------------------

    def send(self, identity: bytes, msg: Message) -> None:
        self.socket_front.send(identity, msg)

    def _handle_safely(self, inbound: Inbound) -> None:
        try:
            caller = self.curve.identify(inbound.user_id) if self.curve is not None else OPERATOR
            self._handle(inbound.identity, caller, inbound.msg, inbound.size)
        except ProtocolError as e:
            self.send(inbound.identity, Error(e.code, e.message, e.request_id))
        except Exception as e:  # a bug answering one message must not stop the daemon
            log.exception("internal error handling a message")
            self.send(inbound.identity, Error(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}",
                                              getattr(inbound.msg, "request_id", None)))

    def _handle(self, identity: bytes, caller: Caller, msg: Message, size: int) -> None:
        if isinstance(msg, Generate):
            self._on_generate(identity, caller, _as_caller(msg, caller), size)
        elif isinstance(msg, Cancel):
            self._on_cancel(identity, caller, msg)
        elif isinstance(msg, Stats):
            self.lane.stats(caller, lambda answer: self.send(identity, answer if isinstance(answer, Error)
                                                             else Stats(answer)))
        else:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{msg.TYPE!r} is a reply, not a request",
                                getattr(msg, "request_id", None))

    def _on_generate(self, identity: bytes, caller: Caller, msg: Generate, size: int) -> None:
        """A retry of a request already known joins it (running, finished or being prepared);
        a new one passes admission, is prepared (here when the lane says it is quick), then
        ``_admit``."""
        entry = self.ledger.get(msg.request_id)
        joined = entry.rejoin(identity, msg) if entry is not None else self.preparer.rejoin(identity, msg)
        if joined is not None:
            for reply in joined:
                self.send(identity, reply)
            return
        self.counters.requests += 1
        refusal = self._admission_error(caller, msg)
        if refusal is not None:
            self._reject(identity, msg, refusal)
            return
        self.in_flight.admit(msg.robot_id)  # given back when it is answered (answer_unstarted, finish)
        self.preparer.start(identity, msg, functools.partial(self.lane.prepare, msg), self._admit,
                            here=self.lane.prepares_here(size))

    def _admission_error(self, caller: Caller, msg: Generate) -> Error | None:
        """Why a new request is refused on arrival (None: admitted; its request is then charged)."""
        rid, robot = msg.request_id, msg.robot_id
        if self.draining:
            return Error(ErrorCode.REJECTED, f"{self.config.daemon} is shutting down", rid)
        grants = self.config.priority_grants
        if not caller.operator_key and not grants.allows(robot, msg.priority):
            granted = ", ".join(p.value for p in sorted(grants.classes_for(robot), key=lambda p: p.rank)) or "none"
            return Error(ErrorCode.FORBIDDEN, f"priority {msg.priority.value!r} is not granted to {robot!r} "
                         f"(granted: {granted}; see [serve] priority_grants)", rid)
        refusal = self.lane.refusal(msg)
        if refusal is not None:
            return refusal
        if not self.in_flight.has_room(robot):
            return Error(ErrorCode.REJECTED, f"robot {robot!r} has {self.in_flight.limit} requests in flight, its "
                         f"share of {self.config.daemon}: send more as they end", rid)
        return self._quota_error(msg, tokens=0, requests=1)

    def _quota_error(self, msg: Generate, tokens: int, requests: int) -> Error | None:
        """Charge ``requests`` and ``tokens`` to ``msg``'s robot; the error if it is over its quota."""
        if not self.quotas.config.enabled or (wait := self.quotas.charge(msg.robot_id, tokens, requests)) <= 0:
            return None
        if math.isinf(wait):
            return Error(ErrorCode.INVALID_REQUEST, f"quota: {tokens} tokens (the prompt's and max_tokens "
                         f"{msg.sampling.max_tokens}) are more than robot {msg.robot_id!r} may use in a minute",
                         msg.request_id)
        return Error(ErrorCode.REJECTED, f"quota: robot {msg.robot_id!r} is over its rate; retry after "
                     f"{wait:.1f} s", msg.request_id, retry_after_ms=math.ceil(wait * 1000))

    def _admit(self, pending: Admitting, done: Future[P]) -> None:
        """Start a prepared request in the lane, or answer why it never runs."""
        rid = pending.msg.request_id
        try:
            prepared = done.result()
        except ValueError as e:
            return self.answer_unstarted(pending, Error(ErrorCode.INVALID_REQUEST, str(e), rid))
        except Exception as e:  # a bug preparing one request must not take the daemon down
            log.exception("failed to prepare a request")
            return self.answer_unstarted(pending, Error(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}", rid))
        if pending.cancelled_by:
            return self.answer_unstarted(pending, self.lane.cancelled_before_start(rid, prepared))
        tokens = self._prompt_tokens(pending.msg, prepared) + pending.msg.sampling.max_tokens
        over_quota = self._quota_error(pending.msg, tokens, requests=0)
        if over_quota is not None:
            return self.answer_unstarted(pending, over_quota)
        entry = self.ledger.open(pending.msg, pending.identities[0])
        for identity in pending.identities[1:]:
            entry.subscribe(identity)
        try:
            self.lane.start(pending, prepared)
        except Refused as e:
            self.ledger.discard(rid)
            return self.answer_unstarted(pending, e.reply)
        self.executions.started(rid)

    def answer_unstarted(self, pending: Admitting, reply: Error | Result) -> None:
        """Answer a request that never ran: its senders, and those who cancelled it meanwhile."""
        self.in_flight.release(pending.msg.robot_id)
        if isinstance(reply, Error):
            self._count_reject(pending.msg, reply)
        for identity in pending.everyone:
            self.send(identity, reply)

    def _reject(self, identity: bytes, msg: Generate, error: Error) -> None:
        self._count_reject(msg, error)
        self.send(identity, error)

    def _count_reject(self, msg: Generate, error: Error) -> None:
        self.counters.rejected += 1
        self.lane.on_reject(msg, error)

    def _on_cancel(self, identity: bytes, caller: Caller, msg: Cancel) -> None:
        if self.preparer.cancel(msg.request_id, identity, caller.robot):  # answered (abort) once prepared
            return
        reply = self.ledger.cancel(msg.request_id, identity, caller.robot)
        if reply is not None:
            self.send(identity, reply)
        else:  # the lane ends it; its result goes to every subscriber, the canceller among them
            self.lane.cancel(msg.request_id)

    # --- what the lane reports (the loop's thread) ----------------------------------------------

    def live(self, request_id: str) -> LedgerEntry | None:
        """A running request's entry: its subscribers and its output so far."""
        return self.ledger.live.get(request_id)

    def emit(self, request_id: str, token_ids: tuple[int, ...] | list[int], text: str,
             source: Source = Source.CLOUD) -> None:
        """A running request's new output: kept for its result, streamed to its subscribers."""
        entry = self.ledger.live.get(request_id)
        if entry is None:
            return
        entry.text.append(text)
        entry.token_ids.extend(token_ids)
        if entry.stream and (token_ids or text):
            chunk = Chunk(request_id, entry.next_seq, tuple(token_ids), text, source)
            entry.chunks.append(chunk)
            for identity in entry.subscribers:
                self.send(identity, chunk)

    def finish(self, request_id: str, reply: Result | Error) -> None:
        """A running request ended: a result is kept for retries; after an error it is forgotten,
        so that a retry under its id runs it anew. Every subscriber hears it."""
        entry = self.ledger.live.get(request_id)
        if entry is None:
            return
        self.in_flight.release(entry.robot_id)
        if isinstance(reply, Result):
            self.ledger.close(request_id, reply, time.monotonic())
            self.executions.ended(request_id, reply.finish_reason, KeptResult(
                request_id, entry.fingerprint, entry.stream, entry.robot_id, reply, time.time()))
        else:
            self.ledger.discard(request_id)
            self.executions.ended(request_id, reply.code.value)
        for identity in entry.subscribers:
            self.send(identity, reply)


def _as_caller(msg: Generate, caller: Caller) -> Generate:
    """``msg`` as ``caller`` may send it: a robot's ids in its own namespace, its own robot_id."""
    if caller.robot is None:
        return msg
    if not msg.request_id.startswith(caller.robot + "/"):
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"request_id {msg.request_id!r}: robot "
                            f"{caller.robot!r}'s request ids start with '{caller.robot}/'", msg.request_id)
    return replace(msg, robot_id=caller.robot)
