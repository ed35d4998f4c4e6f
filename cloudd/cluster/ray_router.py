"""The fleet router as a Ray Serve ``RequestRouter``: a thin adapter from Ray's replicas and
pending requests to ``routing.FleetRouting``. It runs on Ray's router thread inside the process
that holds the handle (the cluster front). Requests without a ``RouteHint`` first argument, and
the ``pow2`` policy, take Ray's own power-of-two-choices procedure (this class extends it).
"""

from __future__ import annotations

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from cloudd.cluster import routing


class FleetRequestRouter(PowerOfTwoChoicesRequestRouter):
    def initialize_state(self, **routing_config) -> None:
        """``routing_config``: ``routing.RoutingConfig``'s fields (``request_router_kwargs``)."""
        self.fleet = routing.FleetRouting(routing.RoutingConfig(**routing_config))
        routing.ROUTERS[self.app_name] = self.fleet

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        hint = _hint(pending_request)
        if hint is not None:
            by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
            ranks = self.fleet.rank(list(by_id), hint)
            if ranks is not None:
                return [[by_id[i] for i in rank] for rank in ranks]
        return await super().choose_replicas(candidate_replicas, pending_request)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        hint = _hint(pending_request)
        if hint is not None:
            self.fleet.routed(hint, replica_id.unique_id, pending_request.metadata.internal_request_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.fleet.completed(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.fleet.set_replicas([r.replica_id.unique_id for r in replicas])

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.fleet.set_replicas([r for r in self.fleet.replicas if r != replica_id.unique_id])


def _hint(pending_request: PendingRequest | None) -> routing.RouteHint | None:
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, routing.RouteHint) else None
