"""One cloudd replica as a Ray Serve deployment: the engine with the fleet policy behind a
``CloudServer`` (the same loop, preparing thread, ledger and policy as ``cloudd serve``), which
this class talks to over ``inproc`` with the protocol.

``generate`` streams a request's replies in batches (all the replies a step produced go as one
item: Ray delivers a few thousand items a second, a busy engine makes more); ``stats`` and
``cancel`` are the protocol's, for one replica. Ray probes ``check_health`` and
restarts a replica whose loop has died; ``record_autoscaling_stats`` feeds the autoscaling
policy (``fleet_autoscaling_policy``) its queue depth and KV usage.
"""

from __future__ import annotations

from shared.config import SERVER_SPIN_COUNT, respond_between_steps, set_openmp_wait_defaults

set_openmp_wait_defaults(SERVER_SPIN_COUNT)  # NOTE: before torch loads

import argparse  # noqa: E402
import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import threading  # noqa: E402
from collections.abc import AsyncIterator  # noqa: E402

from cloudd.assembly import build_serving_engine  # noqa: E402
from cloudd.cluster.routing import RouteHint  # noqa: E402
from shared.protocol.codec import decode, encode  # noqa: E402
from shared.protocol.messages import Error, ErrorCode, Generate, Result  # noqa: E402

log = logging.getLogger(__name__)
REPLY_WAIT_S = 600.0  # a stream silent this long is presumed stuck (a step takes well under a second)


class EngineReplica:
    """``serve_args``: ``cloudd cluster serve``'s engine arguments (model, config, dtype, ...)
    as a dict; ``num_threads``: the cores this replica's ops use (its Ray CPUs)."""

    def __init__(self, serve_args: dict, num_threads: int):
        import torch
        from ray import serve

        from cloudd.server import CloudServer
        from shared.transport.client import FleetClient

        torch.set_num_threads(max(1, num_threads))
        serving = build_serving_engine(argparse.Namespace(**serve_args))
        # NOTE: the front owns the robots' connections (CURVE, quotas, priority grants, a robot's
        # share in flight, the ledger that resumes); a replica serves only the front, over inproc,
        # and admits whatever the front sent
        internal = dataclasses.replace(serving.serve.admitting_all(), zmq_host="127.0.0.1", zmq_port=0,
                                       curve_secret_key="", curve_authorized_dir="", curve_operator_dir="",
                                       execution_log="")
        respond_between_steps()
        self.engine = serving.engine
        self.server = CloudServer(serving.engine, internal, model_name=serving.model_name)
        self.client = FleetClient(self.server.inproc_endpoint, context=self.server.context)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._loop = threading.Thread(target=self.server.serve_forever, name="cloudd-engine", daemon=True)
        self._loop.start()
        log.info("replica %s ready (pid %d)", self.replica_id, os.getpid())

    async def generate(self, hint: RouteHint, payload: bytes) -> AsyncIterator[list[bytes]]:
        """The replies to one encoded ``generate``, a step's worth per item, ending with its
        ``result`` or ``error``. Cancelled by the caller: the request is cancelled here too."""
        request = decode(payload)
        if not isinstance(request, Generate):
            yield [encode(Error(ErrorCode.BAD_MESSAGE, "generate expected", hint.request_id))]
            return
        loop, ready = asyncio.get_running_loop(), asyncio.Event()
        # NOTE: woken by the client's I/O thread, not a thread blocked per stream: with the default
        # pool's few threads parked on queued requests, running ones' replies waited (TPOT p99 3.4 s)
        call = self.client.start(request, notify=lambda: loop.call_soon_threadsafe(ready.set))
        try:
            while True:
                await asyncio.wait_for(ready.wait(), REPLY_WAIT_S)
                ready.clear()
                replies = call.ready_replies()
                if not replies:
                    continue
                yield [encode(r) for r in replies]
                if isinstance(replies[-1], Result | Error):
                    return
        finally:
            if not call.done.is_set():
                self.client.cancel_nowait(request.request_id)

    async def stats(self, hint: RouteHint) -> dict:
        """This replica's ``stats`` reply (as ``cloudd serve`` gives it), with ``replica`` and ``pid``."""
        values = await asyncio.to_thread(self.client.stats, 10.0)
        return {**values, "replica": self.replica_id, "pid": os.getpid()}

    async def cancel(self, hint: RouteHint, request_id: str) -> None:
        """Cancel a request running here; its own stream carries how it ended."""
        self.client.cancel_nowait(request_id)

    def check_health(self) -> None:
        """Ray's probe: an engine loop that has ended takes the replica down (Ray restarts it). A
        slow step does not: on a busy machine a long prefill step took over 10 s, and restarting
        the replica for it threw away its cache and its 43 requests."""
        if not self._loop.is_alive():
            raise RuntimeError("the engine loop has stopped")

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Waiting requests and the KV pool's used fraction (read without locks: counters)."""
        scheduler, pool = self.engine.scheduler, self.engine.pool
        return {"queue_depth": float(len(scheduler.waiting) + len(scheduler.awaiting_grammar)),
                "kv_usage": pool.num_used / max(1, pool.num_blocks - 1)}

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()
