"""cloudd's core: the engine as the lane of a request front (``shared.transport.request_front``).

The front's socket thread answers ``health`` and malformed messages at once (so a client's
heartbeat is answered even while a long engine step runs) and hands the rest to the front's
loop, which owns the ledger and runs the request lifecycle: retries join, ``generate`` requests
are tokenized and checked (``Engine.prepare``) on the preparing thread unless small, admitted
into the engine, cancelled, answered. Between messages the loop runs one engine step while any
request is unfinished (``CloudServer.work``) and sends each delta to the request's subscribers.
Nothing else touches the engine's state (``prepare`` reads only the tokenizer, the model's
config and the grammar compiler), so it needs no lock. The HTTP front end (``cloudd.http_api``)
is a protocol client of this server over ``inproc``.

Bad input never stops the loop (see the front). ``stop()`` (or SIGTERM/SIGINT in ``cloudd
serve``) drains: new requests are rejected, running ones get ``shutdown_grace_s`` to finish, the
rest are cancelled with a ``result`` (finish reason ``abort``) so every client hears how its
request ended.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import zmq

from cloudd.metrics import ServerMetrics
from cloudd.monitor import FleetMonitor, RequestRecord, robot_view
from shared.engine.engine import DeadlineUnmeetable, Engine, PreparedPrompt, TokenDelta
from shared.engine.grammar.response_format import GrammarSpec
from shared.engine.request import FinishReason, Request
from shared.engine.request_budget import HeavyWork
from shared.engine.sampling_params import SamplingParams
from shared.model.summary import ModelSummary
from shared.plan.answer import StructuredAnswer
from shared.protocol.messages import MAX_PROMPT_IDS, Error, ErrorCode, Generate, Priority, Result, Source, Usage
from shared.transport.curve import Caller, ClientCurve, check_server_keys
from shared.transport.loopback import is_loopback
from shared.transport.preparing import Admitting
from shared.transport.priority_grants import PriorityGrants
from shared.transport.quota import QuotaConfig
from shared.transport.request_front import FrontConfig, Lane, Refused, RequestFront

log = logging.getLogger(__name__)
# A generate frame up to this size is prepared on the engine's thread: at most about a millisecond
# of tokenizing (0.27 ms a KB here) and a few of a new grammar's check; larger ones on the
# preparing thread, so that they neither hold the steps nor queue the small ones behind them.
PREPARE_HERE_BYTES = 4096
# After a step that one request's own work held past stall_after_s, health says "degraded",
# naming it, for this long: an operator polling every few seconds sees it.
DEGRADED_FOR_S = 60.0


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
    http_timeout_s: float = 30.0  # the most an HTTP request head, a body or one write to a client may take
    stall_after_s: float = 10.0  # an engine turn running longer: health answers "stalled"
    http_max_connections: int = 256  # HTTP generation requests in progress (not connections); the next: 503
    # Per-robot limits (shared.transport.quota; 0 = off), on by default. The busiest robot of the
    # fleet traces (shared/workloads: 32 to 256 robots) sends 4 requests in a second, 6 in ten, 15 in
    # a minute, and 12,150 tokens (prompt + max_tokens) in a minute: these leave it 2.5-4x headroom.
    robot_requests_per_s: float = 1.0
    robot_burst: int = 20
    robot_tokens_per_min: float = 30_000.0  # prompt tokens + max_tokens
    # requests one robot may have admitted and unanswered (its share of max_waiting: one robot's
    # flood fills its share, never the queue); the traces' busiest robot has 6 at most
    robot_max_in_flight: int = 64
    # per sender (its CURVE key, else its connection; not this process's HTTP front): frames past
    # this rate are dropped unread. A robot's requests, cancels and heartbeats stay under 10 a second
    frames_per_s: float = 50.0
    frames_burst: int = 500
    # priority classes (shared.transport.priority_grants): an identity (a robot key's name, else
    # the robot_id sent: an API key's name over HTTP) may use the classes of the first pattern
    # of priority_grants it matches, else ``priorities``; operator keys may use every class
    priorities: tuple[str, ...] = ("interactive", "plan", "background")
    priority_grants: dict[str, tuple[str, ...]] = field(default_factory=dict)  # name or fnmatch pattern -> classes
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
        check_server_keys(self.curve_secret_key, self.curve_authorized_dir, self.curve_operator_dir)
        if not self.curve_secret_key and not is_loopback(self.zmq_host):
            raise ValueError(f"zmq_host {self.zmq_host!r} is not loopback: set curve_secret_key and "
                             "curve_authorized_dir, so that only the fleet's keys get in")
        if self.robot_max_in_flight < 0 or self.robot_max_in_flight >= self.max_waiting:
            raise ValueError(f"robot_max_in_flight must be in [0, max_waiting {self.max_waiting}), so that one robot "
                             f"never fills the queue; got {self.robot_max_in_flight}")
        self.priority_classes()  # a ValueError naming an unknown class
        if not is_loopback(self.http_host) and not self.http_api_keys:
            raise ValueError(f"http_host {self.http_host!r} is not loopback: set http_api_keys, so that only "
                             "holders of the fleet's API keys get in")

    def without_robot_quotas(self) -> ServeConfig:
        """These settings with no per-robot quota (requests a second, tokens a minute, requests in
        flight): for a load test from one anonymous client, which the quotas take for one robot."""
        return replace(self, robot_requests_per_s=0.0, robot_tokens_per_min=0.0, robot_max_in_flight=0)

    def admitting_all(self) -> ServeConfig:
        """These settings with admission left to whoever sends: no per-robot or per-sender limits
        and every priority class for everyone. For a front whose sender already decided: a
        cluster replica behind the cluster's front, a bench replaying a whole fleet."""
        return replace(self.without_robot_quotas(), frames_per_s=0.0, priorities=tuple(p.value for p in Priority),
                       priority_grants={})

    def priority_classes(self) -> PriorityGrants:
        return PriorityGrants.from_config(self.priorities, self.priority_grants)

    def front(self, *endpoints: str, max_prompt_ids: int = MAX_PROMPT_IDS) -> FrontConfig:
        """The request front of these settings, on ``endpoints`` and then the ZeroMQ TCP port;
        ``max_prompt_ids``: the engine's ``max_model_len`` where it is known."""
        return FrontConfig(
            daemon="cloudd", endpoints=(*endpoints, f"tcp://{self.zmq_host}:{self.zmq_port}"),
            result_ttl_s=self.result_ttl_s, shutdown_grace_s=self.shutdown_grace_s, stall_after_s=self.stall_after_s,
            execution_log=self.execution_log,
            robot_quota=QuotaConfig(self.robot_requests_per_s, self.robot_burst, self.robot_tokens_per_min),
            frame_quota=QuotaConfig(requests_per_s=self.frames_per_s, burst=self.frames_burst),
            robot_max_in_flight=self.robot_max_in_flight, priority_grants=self.priority_classes(),
            max_prompt_ids=max_prompt_ids,
            curve_secret_key=self.curve_secret_key, curve_authorized_dir=self.curve_authorized_dir,
            curve_operator_dir=self.curve_operator_dir,
        )


@dataclass(frozen=True)
class CloudPrepared:
    """What the preparing thread made of a ``generate``."""

    prompt: PreparedPrompt
    params: SamplingParams


class CloudServer(Lane[CloudPrepared]):
    """The engine as the lane of a ``RequestFront``: requests run in ``engine``, one step per
    turn of the front's loop while any is unfinished."""

    def __init__(self, engine: Engine, config: ServeConfig, model_name: str, context: zmq.Context | None = None):
        self.engine = engine
        self.config = config
        self.model_name = model_name
        self.monitor = FleetMonitor(model_name, engine.scheduler.policy.name,
                                    model_summary=ModelSummary.of(model_name, engine.runner.model.config))
        self.metrics = ServerMetrics(config.max_robot_labels)
        self._requests: dict[str, Request] = {}  # live engine requests by id (for results)
        self._specs: dict[str, GrammarSpec] = {}  # the grammar of each live constrained request (its plan)
        # the request whose own work made a step slow, and until when (the engine's clock) health says so
        self._slow_step: tuple[HeavyWork, float] | None = None
        self.inproc_endpoint = f"inproc://cloudd-{id(self):x}"  # for clients in this process (HTTP)
        front = config.front(self.inproc_endpoint, max_prompt_ids=engine.scheduler.config.max_model_len)
        self.front: RequestFront[CloudPrepared] = RequestFront(
            self, front, context, on_frame_dropped=self.metrics.frames_dropped.inc,
            prompt_tokens=lambda _msg, prepared: len(prepared.prompt.token_ids))
        self.context = self.front.context
        self.ledger = self.front.ledger
        self.socket = self.front.socket_front.socket  # the ROUTER socket clients connect to
        self.endpoint = self.front.endpoints[1]
        # what a client in this process connects with
        self.local_curve: ClientCurve | None = self.front.curve.local_client() if self.front.curve else None

    # --- the lane ---------------------------------------------------------------------------------

    def refusal(self, msg: Generate) -> Error | None:
        """A full queue; token ids that cannot fit ``max_model_len`` (refused before any work:
        a frame of 131,072 ids is not even prepared)."""
        queued = self.engine.scheduler
        if len(queued.waiting) + len(queued.awaiting_grammar) + len(self.front.preparer) >= self.config.max_waiting:
            return Error(ErrorCode.REJECTED, f"overloaded: {self.config.max_waiting} requests waiting", msg.request_id)
        tokens, limit = len(msg.prompt_ids) + len(msg.resume_token_ids), queued.config.max_model_len
        if tokens >= limit:
            return Error(ErrorCode.INVALID_REQUEST, f"prompt_ids and resume_token_ids hold {tokens} tokens: "
                         f"no room for output within max_model_len {limit}", msg.request_id)
        return None

    def prepares_here(self, size: int) -> bool:
        return size <= PREPARE_HERE_BYTES

    def prepare(self, msg: Generate) -> CloudPrepared:
        params = SamplingParams.from_wire(msg.sampling)
        prompt = [m.as_dict() for m in msg.messages] or list(msg.prompt_ids)
        return CloudPrepared(self.engine.prepare(prompt, msg.response_format), params)

    def start(self, pending: Admitting, prepared: CloudPrepared) -> None:
        msg, rid = pending.msg, pending.msg.request_id
        deadline_s = pending.deadline_left_s()  # it counts from the request's arrival
        if deadline_s is not None and deadline_s <= 0:
            raise Refused(Error(ErrorCode.DEADLINE, "the deadline passed while the prompt was being prepared", rid))
        try:
            self.engine.submit(prepared.prompt, prepared.params, rid, buffered=False, priority=msg.priority,
                               robot_id=msg.robot_id, deadline_s=deadline_s, resume_token_ids=msg.resume_token_ids)
        except DeadlineUnmeetable as e:
            raise Refused(Error(ErrorCode.DEADLINE, str(e), rid)) from e
        except ValueError as e:
            raise Refused(Error(ErrorCode.INVALID_REQUEST, str(e), rid)) from e
        self._requests[rid] = self.engine.get_request(rid)
        if prepared.prompt.spec is not None:
            self._specs[rid] = prepared.prompt.spec
        self.monitor.on_submit(msg.robot_id)

    def cancelled_before_start(self, request_id: str, prepared: CloudPrepared) -> Result:
        return Result(request_id, "", FinishReason.ABORT.value, Usage(len(prepared.prompt.token_ids), 0),
                      detail="cancelled")

    def cancel(self, request_id: str) -> None:
        self._publish(self.engine.abort(request_id))

    def cancel_all(self, why: str) -> None:
        for rid in list(self._requests):
            self.cancel(rid)
        log.info("cancelled live requests: %s", why)

    def stats(self, caller: Caller, reply: Callable[[dict | Error], None]) -> None:
        snapshot = self.snapshot()
        reply(snapshot if caller.robot is None else robot_view(snapshot, caller.robot))

    def wait_ms(self) -> int:
        return 0 if self.engine.has_unfinished else self.config.idle_poll_ms

    def work(self) -> None:
        if not self.engine.has_unfinished:
            return
        try:
            deltas = self.engine.step()
        except Exception:  # the scheduler itself failed (a request's own failure ends it alone)
            log.exception("engine step failed: failing every live request")
            self._fail_all("internal error in the engine")
            return
        heaviest = self.engine.budget.take_heaviest()
        if heaviest is not None and heaviest.seconds > self.config.stall_after_s:
            self._slow_step = (heaviest, self.engine.clock() + DEGRADED_FOR_S)
        for delta in deltas:
            self._publish(delta)
        self.metrics.on_engine(self.engine.stats())

    def degraded(self) -> str | None:
        """The request whose own grammar and detokenizer work held a step past
        ``stall_after_s``, for ``DEGRADED_FOR_S`` after that step."""
        slow = self._slow_step
        if slow is None or self.engine.clock() > slow[1]:
            return None
        return slow[0].describe()

    def on_reject(self, msg: Generate, error: Error) -> None:
        self.monitor.on_reject()
        self.metrics.on_reject(msg.priority.value, error.code.value)

    # --- output -----------------------------------------------------------------------------------

    def _publish(self, delta: TokenDelta | None) -> None:
        if delta is None or self.front.live(delta.request_id) is None:
            return
        self.front.emit(delta.request_id, delta.token_ids, delta.text)
        self.monitor.on_tokens(len(delta.token_ids))
        if delta.finished:
            self._finish(self._requests.pop(delta.request_id), delta.detail)

    def _finish(self, req: Request, detail: str | None = None) -> None:
        """Send ``req``'s result, with its ``plan`` when its grammar is JSON and its text decodes to
        an object (the one parse of a cloud answer: edged and the SDK read it); one that failed in
        the engine (finish reason ``error``) is answered ``internal`` instead, and forgotten, so
        that a retry runs it again, or ``invalid_request`` with the engine's ``detail`` when its
        own cost ended it (its work budget). A result's detail is the engine's when it gave one
        (a grammar that failed to compile or ran past its time limit)."""
        spec = self._specs.pop(req.request_id, None)
        record = RequestRecord.of(req, self.monitor.clock())
        self.monitor.on_finish(record)
        self.metrics.on_finish(record)
        if req.finish_reason is FinishReason.ERROR and detail is not None:
            self.front.finish(req.request_id, Error(ErrorCode.INVALID_REQUEST, detail, req.request_id))
            return
        if req.finish_reason is FinishReason.ERROR:
            self.front.finish(req.request_id, Error(ErrorCode.INTERNAL, "internal error serving this request "
                                                    "(cloudd's log has the trace); the fleet's other requests go on",
                                                    req.request_id))
            return
        entry = self.front.live(req.request_id)
        text = "".join(entry.text)
        self.front.finish(req.request_id, Result(
            request_id=req.request_id,
            text=text,
            finish_reason=record.finish_reason,
            usage=Usage(req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens),
            token_ids=tuple(entry.token_ids),
            source=Source.CLOUD,
            plan=None if spec is None else StructuredAnswer.parse(text, spec).plan,
            timings=record.timings(),
            detail=detail or _detail(req),
        ))

    def _fail_all(self, why: str) -> None:
        """End every live request with an ``internal`` error (a retry under its id runs it anew)."""
        for rid in list(self._requests):
            self.engine.abort(rid)
            self._requests.pop(rid)
            self._specs.pop(rid, None)
            self.front.finish(rid, Error(ErrorCode.INTERNAL, why, rid))
        log.info("failed live requests: %s", why)

    def snapshot(self) -> dict:
        """The ``stats`` reply (see ``cloudd.monitor``), with ``kv_check``: while the engine is
        idle, "ok" when every KV block is free or held by the prefix cache alone and the cache's
        structures agree (else what is wrong); "busy" while requests run."""
        snapshot = self.monitor.snapshot(self.engine.stats(), self._requests.values(), self.front.draining,
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


def _detail(req: Request) -> str | None:
    """Words for an ending the finish reason alone does not explain."""
    if req.grammar is not None and not req.grammar.finished and req.finish_reason is FinishReason.LENGTH:
        return "max_tokens ran out before the response_format was complete: the text does not parse"
    if req.finish_reason is FinishReason.DEADLINE:
        return "the deadline passed: the text is what was generated by then"
    return None

