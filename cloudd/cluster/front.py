"""The cluster's front: the one process that robots, fleetctl and HTTP clients talk to.

It is the lane of a request front (``shared.transport.request_front``), the same front as
``cloudd serve``'s: the same socket, CURVE keys and robot identity, quotas, frame limits and
idempotency ledger, so a retry under a known request id joins the request wherever it runs, or
gets its kept result, exactly as with one cloudd. Each ``generate`` goes to a replica through the
Serve handle, whose request router (``ray_router``) picks the replica; the replica streams its
replies back a step at a time and the front relays them, numbering the chunks itself.

A replica that dies mid-request (``RayActorError``: its process is gone or unreachable) loses
nothing: the front sends the request again (under a resumption id of its own, so that a replica
that was only unreachable cannot rejoin it to the first execution) to another replica with
``resume_token_ids`` = the tokens its client already has, so generation continues where it
stopped (the prompt and those tokens are recomputed there) and every token reaches the client
once. Ray restarts the dead replica after its health check. A request resumed more than
``resume_retries`` times fails ``unavailable``.

Quotas charge a request's prompt tokens as ``cloudd serve``'s do: the front counts a chat
prompt's tokens with the model's tokenizer (``count_prompt``) as it prepares the request (off its
loop past ``PREPARE_HERE_BYTES``), the replicas tokenize it again for themselves.

Fair admission: the front holds every robot's in-flight work. It lets at most
``dispatch_per_replica`` requests per running replica be in the replicas at once; the rest wait
at the front in a queue per robot, and each freed slot goes to the waiting robot holding the
fewest requests in the replicas (``fair_dispatch``: max-min fairness across the cluster, most
urgent first within a robot; ``safety`` never waits). So a robot flooding the cluster (the
router keeps a robot on one replica, the load guard spills its excess onto the others) cannot
take more than its share: once others are waiting, it gets a slot only when it holds no more
than they do. Each replica's policy still orders what it holds by class, deadline and fairness.

Threads: the front's loop owns the ledger and the fair queue; the replica calls run as coroutines on an asyncio
loop of their own (the dispatch thread), which hands every reply back to the front's loop
through its mailbox. The router's state lives in this process too (``routing.ROUTERS``), so
cancels reach the request's replica and ``stats`` shows the router's decisions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Callable, Coroutine

import zmq

from cloudd.cluster.cluster_stats import merge_snapshots
from cloudd.cluster.config import ClusterConfig
from cloudd.cluster.fair_dispatch import FairDispatch
from cloudd.cluster.prefix_pages import page_keys, routing_text
from cloudd.cluster.routing import ANY_REPLICA, ROUTERS, FleetRouting, RouteHint
from cloudd.monitor import robot_view
from shared.engine.request import FinishReason
from shared.protocol.codec import decode, encode
from shared.protocol.messages import MAX_REQUEST_ID_CHARS, Chunk, Error, ErrorCode, Generate, Message, Result, Usage
from shared.transport.curve import Caller, ClientCurve
from shared.transport.preparing import Admitting
from shared.transport.request_front import FrontConfig, Lane, RequestFront

log = logging.getLogger(__name__)
STATS_TIMEOUT_S = 10.0
# A generate frame up to this size is counted on the front's loop (a millisecond of tokenizing at
# most), larger ones on the preparing thread, as cloudd serve's engine lane does
PREPARE_HERE_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class Routed:
    """A request as the front prepared it: what the replicas get, and its prompt's tokens."""

    msg: Generate
    prompt_tokens: int


class ClusterFront(Lane[Routed]):
    """``handle``: the replicas' Serve deployment handle; ``app_name``: its application (whose
    router this process holds). ``front``'s endpoints get an ``inproc`` one first (for the HTTP
    API's client in this process, as ``cloudd serve`` has). ``replicas``: how many run until the
    router reports them; ``dispatch_per_replica``: see fair admission above; ``count_prompt``:
    a chat request's prompt tokens (the model's chat template and tokenizer; None: only
    ``prompt_ids`` are counted)."""

    def __init__(self, handle, app_name: str, front: FrontConfig, resume_retries: int, model_name: str,
                 context: zmq.Context | None = None, *, replicas: int = ClusterConfig.replicas,
                 dispatch_per_replica: int = ClusterConfig.dispatch_per_replica,
                 count_prompt: Callable[[Generate], int] | None = None):
        if replicas < 1 or dispatch_per_replica < 1:
            raise ValueError("replicas >= 1, dispatch_per_replica >= 1")
        self.handle = handle
        self.app_name = app_name
        self.resume_retries = resume_retries
        self.model_name = model_name
        self.replicas = replicas
        self.dispatch_per_replica = dispatch_per_replica
        self.fair: FairDispatch[Generate] = FairDispatch()  # the front's loop only
        self.resumed = 0  # requests sent again after their replica died
        self.inproc_endpoint = f"inproc://cluster-front-{id(self):x}"
        self.count_prompt = count_prompt
        self.front: RequestFront[Routed] = RequestFront(
            self, dataclasses.replace(front, endpoints=(self.inproc_endpoint, *front.endpoints)), context,
            prompt_tokens=lambda _msg, routed: routed.prompt_tokens)
        self.context = self.front.context
        self.endpoint = self.front.endpoints[1]
        self.local_curve: ClientCurve | None = self.front.curve.local_client() if self.front.curve else None
        self._executions: dict[str, str] = {}  # dispatch thread: request id -> the id its execution runs under
        self._tasks: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._dispatch = threading.Thread(target=self._loop.run_forever, name="cluster-dispatch", daemon=True)
        self._dispatch.start()

    # --- the lane (the front's loop) ---------------------------------------------------------

    def refusal(self, msg: Generate) -> Error | None:
        return None  # each replica's own engine refuses what it cannot queue

    def prepares_here(self, size: int) -> bool:
        return self.count_prompt is None or size <= PREPARE_HERE_BYTES

    def prepare(self, msg: Generate) -> Routed:
        """Counted only: the replica prepares it."""
        counted = msg.messages and self.count_prompt is not None
        return Routed(msg, self.count_prompt(msg) if counted else len(msg.prompt_ids))

    def start(self, pending: Admitting, prepared: Routed) -> None:
        msg = prepared.msg
        self.fair.add(msg.request_id, msg.robot_id, msg.priority, msg)
        self._dispatch_fairly()

    def cancelled_before_start(self, request_id: str, prepared: Routed) -> Result:
        return Result(request_id, "", FinishReason.ABORT.value, Usage(0, 0), detail="cancelled")

    def cancel(self, request_id: str) -> None:
        """A request still waiting at the front ends here; one in a replica is cancelled there."""
        waiting = self.fair.withdraw(request_id)
        if waiting is not None:
            self.front.finish(request_id, self.cancelled_before_start(request_id, waiting))
        else:
            self._spawn(self._cancel(request_id))

    @property
    def capacity(self) -> int:
        """Requests the replicas may hold at once: ``dispatch_per_replica`` per replica running
        (as the router last saw them; before its first request, ``replicas``)."""
        routing = self.routing
        running = len(routing.replicas) if routing is not None and routing.replicas else self.replicas
        return self.dispatch_per_replica * running

    def _dispatch_fairly(self) -> None:
        """The front's loop: send the replicas what fair admission lets through now."""
        for msg in self.fair.take(self.capacity):
            self._spawn(self._run(msg))

    def _end(self, request_id: str, reply: Result | Error) -> None:
        """The front's loop: a dispatched request ends with ``reply``. Its slot is freed first,
        so that a retry under its id (after an error) is a new request to fair admission."""
        self.fair.ended(request_id)
        self.front.finish(request_id, reply)
        self._dispatch_fairly()

    def cancel_all(self, why: str) -> None:
        """Cancel every live request on its replica and wait (up to a second) for their results."""
        for request_id in list(self.front.ledger.live):
            self.cancel(request_id)
        self.front.mailbox.run(wait_s=1.0, until=lambda: not self.front.ledger.live)

    def stats(self, caller: Caller, reply: Callable[[dict | Error], None]) -> None:
        def answer(snapshot: dict | Error) -> None:  # on the dispatch thread
            if isinstance(snapshot, dict) and caller.robot is not None:
                snapshot = robot_view(snapshot, caller.robot)
            self._post(lambda: reply(snapshot))
        self._spawn(self._stats(answer, self.front.health(), {**self.fair.snapshot(), "capacity": self.capacity}))

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._dispatch.join(timeout=5)

    # --- the dispatch thread -----------------------------------------------------------------

    def _spawn(self, coroutine: Coroutine) -> None:
        """Any thread: run ``coroutine`` on the dispatch loop."""
        def create() -> None:
            task = self._loop.create_task(coroutine)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._loop.call_soon_threadsafe(create)

    def _post(self, event: Callable[[], None]) -> None:
        """Dispatch thread: run ``event`` on the front's loop."""
        self.front.mailbox.post(event)

    async def _run(self, msg: Generate) -> None:
        try:
            await self._serve(msg)
        finally:
            self._executions.pop(msg.request_id, None)
            if self.routing is not None:  # ranked but never routed: not load any more
                self.routing.forget(msg.request_id)

    async def _serve(self, msg: Generate) -> None:
        """Serve ``msg`` on a replica, and again after the last token relayed on another while
        replicas die."""
        import ray.exceptions

        received = asyncio.get_running_loop().time()
        text = routing_text([(m.role, m.content) for m in msg.messages], msg.prompt_ids)
        hint = RouteHint(msg.request_id, msg.robot_id, msg.priority.value, tuple(page_keys(text)))
        relayed: list[int] = []  # the tokens its client has
        for attempt in range(self.resume_retries + 1):
            deadline_ms = msg.deadline_ms
            if deadline_ms is not None:  # what is left of it
                deadline_ms = max(1, deadline_ms - int((asyncio.get_running_loop().time() - received) * 1000))
            # NOTE: a resumption runs under an id of its own: a replica that was only unreachable
            # may still hold the first execution, which the same id would rejoin from its start
            execution = msg.request_id if attempt == 0 else f"{msg.request_id[:MAX_REQUEST_ID_CHARS - 12]}~resume{attempt}"
            self._executions[msg.request_id] = execution
            sent = dataclasses.replace(msg, request_id=execution, stream=True, resume_from=0, deadline_ms=deadline_ms,
                                       resume_token_ids=tuple(relayed))
            ended = False
            try:
                async for batch in self.handle.options(method_name="generate", stream=True).remote(hint, encode(sent)):
                    for payload in batch:
                        reply = decode(payload)
                        if isinstance(reply, Chunk):
                            relayed.extend(reply.token_ids)
                        ended = ended or isinstance(reply, Result | Error)
                        self._post(lambda reply=reply: self._relay(msg.request_id, reply))
                if not ended:
                    raise RuntimeError("the replica's stream ended without a result")
                return
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                if ended:
                    return
                self.resumed += 1
                log.warning("%s: its replica died after %d tokens (%s): resuming on another (attempt %d)",
                            msg.request_id, len(relayed), type(e).__name__, attempt + 1)
            except Exception as e:
                log.exception("%s failed", msg.request_id)
                self._post_end(msg.request_id, Error(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}",
                                                     msg.request_id))
                return
        self._post_end(msg.request_id, Error(ErrorCode.UNAVAILABLE, f"its replica died {attempt + 1} times",
                                             msg.request_id))

    def _post_end(self, request_id: str, error: Error) -> None:
        """Dispatch thread: end a request with ``error`` on the front's loop."""
        self._post(lambda: self._end(request_id, error))

    def _relay(self, request_id: str, reply: Message) -> None:
        """The front's loop: a replica's reply, under the request's own id: a chunk numbered in
        the front's sequence, the result with the whole output (a resumed replica's holds only
        what it added), an error as it is. An end frees the request's slot even when it has no
        subscriber left to hear it."""
        entry = self.front.live(request_id)
        if isinstance(reply, Chunk):
            self.front.emit(request_id, reply.token_ids, reply.text, reply.source)  # (nothing once ended)
        elif isinstance(reply, Result):
            self._end(request_id, reply if entry is None else dataclasses.replace(
                reply, request_id=request_id, text="".join(entry.text), token_ids=tuple(entry.token_ids)))
        elif isinstance(reply, Error):
            self._end(request_id, dataclasses.replace(reply, request_id=request_id))

    async def _cancel(self, request_id: str) -> None:
        """Ask the request's replica to cancel it, once the router has placed it."""
        while request_id in self._executions:
            replica = self.routing.replica_of(request_id) if self.routing is not None else None
            if replica is not None:
                await self.handle.options(method_name="cancel").remote(RouteHint(request_id, target=replica),
                                                                       self._executions[request_id])
                return
            await asyncio.sleep(0.01)

    @property
    def routing(self) -> FleetRouting | None:
        """The router of this process's handle (it exists once the handle sent a request)."""
        return ROUTERS.get(self.app_name)

    async def _stats(self, reply: Callable[[dict | Error], None], health: str, admission: dict) -> None:
        """Every replica's snapshot, merged, with ``admission`` (the fair queue's counts, taken on
        the front's loop) as ``cluster.front``. The first comes from any replica: that call also
        makes this handle build its router (Ray builds it on first use), whose replica list
        names the others."""
        stats = self.handle.options(method_name="stats")
        try:
            snapshots = [await asyncio.wait_for(stats.remote(RouteHint("stats", target=ANY_REPLICA)), STATS_TIMEOUT_S)]
        except Exception as e:
            log.warning("stats: no replica answered: %s", type(e).__name__)
            reply(Error(ErrorCode.UNAVAILABLE, f"no replica answered the stats query ({type(e).__name__})"))
            return
        routing = self.routing
        others = [r for r in routing.snapshot()["replicas"] if r != snapshots[0]["replica"]]
        calls = [stats.remote(RouteHint("stats", target=r)) for r in others]
        for replica, call in zip(others, calls, strict=True):
            try:
                snapshots.append(await asyncio.wait_for(call, STATS_TIMEOUT_S))
            except Exception as e:  # a replica restarting: the others still answer
                log.warning("stats of replica %s: %s", replica, type(e).__name__)
        merged = merge_snapshots(snapshots, routing.snapshot(), self.resumed, health)
        merged["cluster"]["front"] = admission
        reply({**merged, "model": self.model_name})
