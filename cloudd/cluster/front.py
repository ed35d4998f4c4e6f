"""The cluster's front: the one process that robots, fleetctl and HTTP clients talk to.

It speaks the protocol of ``cloudd serve`` on a ZeroMQ ROUTER socket and holds the cluster's
idempotency ledger (``shared.transport.ledger``): a retry under a known request id joins the
request wherever it runs, or gets its kept result, exactly as with one cloudd. Each ``generate``
goes to a replica through the Serve handle, whose request router (``ray_router``) picks the
replica; the replica streams its replies back a step at a time and the front relays them,
numbering the chunks itself.

A replica that dies mid-request (``RayActorError``: its process is gone or unreachable) loses
nothing: the front sends the request again (under a resumption id of its own, so that a replica
that was only unreachable cannot rejoin it to the first execution) to another replica with
``resume_token_ids`` = the tokens its client already has, so generation continues where it
stopped (the prompt and those tokens are recomputed there) and every token reaches the client
once. Ray restarts the dead replica after its health check. A request resumed more than
``resume_retries`` times fails ``unavailable``.

Threads: the socket thread reads and answers ``health`` at once (as cloudd's front thread does)
and hands the rest to the dispatch thread, an asyncio loop that owns the ledger and every
request's relay; replies go back to the socket thread over an ``inproc`` pair. The router's
state lives in this process too (``routing.ROUTERS``), so cancels reach the request's replica
and ``stats`` shows the router's decisions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

import zmq

from cloudd.cluster.cluster_stats import merge_snapshots
from cloudd.cluster.prefix_pages import page_keys, routing_text
from cloudd.cluster.routing import ANY_REPLICA, ROUTERS, FleetRouting, RouteHint
from shared.protocol.codec import decode, encode
from shared.protocol.messages import (MAX_REQUEST_ID_CHARS, Cancel, Chunk, Error, ErrorCode, Generate, Health, Message,
                                     Result, Stats)
from shared.transport.ledger import LedgerEntry, RequestLedger
from shared.transport.router import incoming, relay_replies, router_socket, send_nowait, thread_pipe

log = logging.getLogger(__name__)
STATS_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class FrontConfig:
    zmq_host: str = "127.0.0.1"
    zmq_port: int = 5555
    result_ttl_s: float = 300.0
    resume_retries: int = 3


class ClusterFront:
    """``handle``: the replicas' Serve deployment handle; ``app_name``: its application (whose
    router this process holds)."""

    def __init__(self, handle, app_name: str, config: FrontConfig, model_name: str,
                 context: zmq.Context | None = None):
        self.handle = handle
        self.app_name = app_name
        self.config = config
        self.model_name = model_name
        self.context = context or zmq.Context.instance()
        self.ledger = RequestLedger(ttl_s=config.result_ttl_s)
        self.resumed = 0  # requests sent again after their replica died
        self._tasks: set[asyncio.Task] = set()
        self._executions: dict[str, str] = {}  # request id -> the id its current execution runs under
        self._stop = threading.Event()
        self._draining = False
        self.socket = router_socket(self.context)
        if config.zmq_port == 0:
            port = self.socket.bind_to_random_port(f"tcp://{config.zmq_host}")
        else:
            port = config.zmq_port
            self.socket.bind(f"tcp://{config.zmq_host}:{port}")
        self.endpoint = f"tcp://{config.zmq_host}:{port}"
        self._replies_in, self._replies_out = thread_pipe(self.context, f"cluster-front-{id(self):x}")
        self._loop = asyncio.new_event_loop()

    # --- threads -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop taking requests and return from ``serve_forever`` once the live ones end (safe
        from any thread or a signal handler)."""
        self._stop.set()

    def serve_forever(self, grace_s: float = 30.0) -> None:
        dispatch = threading.Thread(target=self._loop.run_forever, name="cluster-dispatch", daemon=True)
        dispatch.start()
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._replies_in, zmq.POLLIN)
        grace_ends = None
        try:
            while True:
                if self._stop.is_set() and grace_ends is None:
                    self._draining = True
                    grace_ends = time.monotonic() + grace_s
                if grace_ends is not None and (not self.ledger.live or time.monotonic() >= grace_ends):
                    break
                events = dict(poller.poll(100))
                if self._replies_in in events:
                    relay_replies(self._replies_in, self.socket)
                if self.socket in events:
                    self._triage()
            relay_replies(self._replies_in, self.socket)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            dispatch.join(timeout=5)
            self._replies_out.close()
            self._replies_in.close()
            self.socket.close()

    def health(self) -> str:
        return "draining" if self._draining else "ok"

    def _triage(self) -> None:
        for identity, _, _, msg in incoming(self.socket):
            if isinstance(msg, Error):
                send_nowait(self.socket, identity, encode(msg))
            elif isinstance(msg, Health):
                send_nowait(self.socket, identity, encode(Health(self.health())))
            else:
                self._loop.call_soon_threadsafe(self._handle, identity, msg)

    def _send(self, identity: bytes, msg: Message) -> None:
        """Dispatch thread: a reply for the socket thread to send."""
        self._replies_out.send_multipart([identity, encode(msg)])

    # --- the dispatch thread -----------------------------------------------------------------

    def _handle(self, identity: bytes, msg: Message) -> None:
        try:
            if isinstance(msg, Generate):
                self._on_generate(identity, msg)
            elif isinstance(msg, Cancel):
                self._on_cancel(identity, msg)
            elif isinstance(msg, Stats):
                self._spawn(self._on_stats(identity))
            else:
                self._send(identity, Error(ErrorCode.BAD_MESSAGE, f"{msg.TYPE!r} is a reply, not a request",
                                           getattr(msg, "request_id", None)))
        except Exception as e:  # a bug must not take the front down
            log.exception("internal error handling a message")
            self._send(identity, Error(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}",
                                       getattr(msg, "request_id", None)))

    def _spawn(self, coroutine) -> None:
        task = self._loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_generate(self, identity: bytes, msg: Generate) -> None:
        self.ledger.expire(time.monotonic())
        entry = self.ledger.get(msg.request_id)
        if entry is not None:
            for reply in entry.rejoin(identity, msg):
                self._send(identity, reply)
            return
        if self._draining:
            self._send(identity, Error(ErrorCode.REJECTED, "server is shutting down", msg.request_id))
            return
        entry = self.ledger.open(msg, identity)
        self._spawn(self._run(msg, entry))

    async def _run(self, msg: Generate, entry: LedgerEntry) -> None:
        try:
            await self._serve(msg, entry)
        finally:
            self._executions.pop(msg.request_id, None)
            if self.routing is not None:  # ranked but never routed: not load any more
                self.routing.forget(msg.request_id)

    async def _serve(self, msg: Generate, entry: LedgerEntry) -> None:
        """Serve ``msg`` on a replica, and again after the last token relayed on another while
        replicas die."""
        import ray.exceptions

        received = time.monotonic()
        text = routing_text([(m.role, m.content) for m in msg.messages], msg.prompt_ids)
        hint = RouteHint(msg.request_id, msg.robot_id, msg.priority.value, tuple(page_keys(text)))
        for attempt in range(self.config.resume_retries + 1):
            deadline_ms = msg.deadline_ms
            if deadline_ms is not None:  # what is left of it
                deadline_ms = max(1, deadline_ms - int((time.monotonic() - received) * 1000))
            # NOTE: a resumption runs under an id of its own: a replica that was only unreachable
            # may still hold the first execution, which the same id would rejoin from its start
            execution = msg.request_id if attempt == 0 else f"{msg.request_id[:MAX_REQUEST_ID_CHARS - 12]}~resume{attempt}"
            self._executions[msg.request_id] = execution
            sent = dataclasses.replace(msg, request_id=execution, stream=True, resume_from=0, deadline_ms=deadline_ms,
                                       resume_token_ids=tuple(entry.token_ids))
            try:
                async for batch in self.handle.options(method_name="generate", stream=True).remote(hint, encode(sent)):
                    for payload in batch:
                        self._relay(msg.request_id, entry, decode(payload))
                if entry.result is None and msg.request_id in self.ledger.live:
                    raise RuntimeError("the replica's stream ended without a result")
                return
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                if msg.request_id not in self.ledger.live:
                    return
                self.resumed += 1
                log.warning("%s: its replica died after %d tokens (%s): resuming on another (attempt %d)",
                            msg.request_id, len(entry.token_ids), type(e).__name__, attempt + 1)
            except Exception as e:
                log.exception("%s failed", msg.request_id)
                self._fail(entry, msg.request_id, Error(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}",
                                                        msg.request_id))
                return
        self._fail(entry, msg.request_id, Error(ErrorCode.UNAVAILABLE, f"its replica died {attempt + 1} times",
                                                msg.request_id))

    def _relay(self, request_id: str, entry: LedgerEntry, reply: Message) -> None:
        """A replica's reply, under the request's own id: a chunk numbered in the front's
        sequence, the result with the whole output (a resumed replica's holds only what it
        added), an error as it is."""
        if isinstance(reply, Chunk):
            entry.text.append(reply.text)
            entry.token_ids.extend(reply.token_ids)
            if entry.stream:
                chunk = dataclasses.replace(reply, request_id=request_id, seq=entry.next_seq)
                entry.chunks.append(chunk)
                for identity in entry.subscribers:
                    self._send(identity, chunk)
        elif isinstance(reply, Result):
            result = dataclasses.replace(reply, request_id=request_id, text="".join(entry.text),
                                         token_ids=tuple(entry.token_ids))
            self.ledger.close(request_id, result, time.monotonic())
            for identity in entry.subscribers:
                self._send(identity, result)
        elif isinstance(reply, Error):
            self._fail(entry, request_id, dataclasses.replace(reply, request_id=request_id))

    def _fail(self, entry: LedgerEntry, request_id: str, error: Error) -> None:
        """Answer a live request with ``error`` and forget it (a retry runs it anew)."""
        self.ledger.discard(request_id)
        for identity in entry.subscribers:
            self._send(identity, error)

    def _on_cancel(self, identity: bytes, msg: Cancel) -> None:
        reply = self.ledger.cancel(msg.request_id, identity)
        if reply is not None:
            self._send(identity, reply)
        else:  # the request's end (abort) goes to the canceller too
            self._spawn(self._cancel(msg.request_id))

    async def _cancel(self, request_id: str) -> None:
        """Ask the request's replica to cancel it, once the router has placed it."""
        while request_id in self.ledger.live:
            replica = self.routing.replica_of(request_id) if self.routing is not None else None
            if replica is not None:
                await self.handle.options(method_name="cancel").remote(RouteHint(request_id, target=replica),
                                                                       self._executions.get(request_id, request_id))
                return
            await asyncio.sleep(0.01)

    @property
    def routing(self) -> FleetRouting | None:
        """The router of this process's handle (it exists once the handle sent a request)."""
        return ROUTERS.get(self.app_name)

    async def _on_stats(self, identity: bytes) -> None:
        """Every replica's snapshot, merged. The first comes from any replica: that call also
        makes this handle build its router (Ray builds it on first use), whose replica list
        names the others."""
        stats = self.handle.options(method_name="stats")
        try:
            snapshots = [await asyncio.wait_for(stats.remote(RouteHint("stats", target=ANY_REPLICA)), STATS_TIMEOUT_S)]
        except Exception as e:
            log.warning("stats: no replica answered: %s", type(e).__name__)
            self._send(identity, Error(ErrorCode.UNAVAILABLE, f"no replica answered the stats query ({type(e).__name__})"))
            return
        routing = self.routing
        others = [r for r in routing.snapshot()["replicas"] if r != snapshots[0]["replica"]]
        calls = [stats.remote(RouteHint("stats", target=r)) for r in others]
        for replica, call in zip(others, calls, strict=True):
            try:
                snapshots.append(await asyncio.wait_for(call, STATS_TIMEOUT_S))
            except Exception as e:  # a replica restarting: the others still answer
                log.warning("stats of replica %s: %s", replica, type(e).__name__)
        merged = merge_snapshots(snapshots, routing.snapshot(), self.resumed, self.health())
        self._send(identity, Stats({**merged, "model": self.model_name}))
