"""Where a request goes: the fleet router's decisions, free of Ray so that tests drive them.

Policies (``[cluster] router``):

- ``fleet``: the replica whose served pages match the request's prompt furthest (its scene and
  history are in that replica's radix cache), counting only pages that robot alone has sent: a
  prefix the whole fleet shares (the system prompt) is soon cached on every replica and says
  nothing of where a robot belongs, and counted it would pull every new robot to the first
  replica. Among equal matches the robot's previous replica, else the least loaded. When in-flight
  counts are imbalanced past both thresholds (the busiest has ``imbalance_abs`` more than the
  idlest and ``imbalance_rel`` times as many), the least loaded replica instead, as SGLang's
  cache-aware router does. ``safety`` requests go to the replica that can start them first: a
  replica's fleet policy preempts lower classes for them, so they wait for no queue anywhere and
  start first where the least of their prompt is left to compute, the longest match (ties: the
  least loaded; sent to the least loaded replica instead, they moved their robots' histories: 28
  robots moved and the hit rate fell 2 points below one replica's in a fleet-1024 replay).
- ``hash``: robot affinity by consistent hashing (64 points per replica on a ring) with bounded
  load: a replica past ``hash_load_factor`` times the mean in-flight count passes the robot on
  along the ring.
- ``pow2``: Ray Serve's default (two random replicas, the shorter queue); ``rank`` returns None.

Every rank lists all candidates, best first, so a replica that refuses (full) spills the request
to the next. Loads are the router's own in-flight counts (Ray's queue-length cache reads 0 for
every replica within a burst).
"""

from __future__ import annotations

import bisect
import hashlib
import math
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from cloudd.cluster.prefix_pages import ReplicaPages

RING_POINTS = 64
SHARED = "\x00shared"  # a page owner: more than one robot sent it
ANY_REPLICA = "*"  # RouteHint.target: a control call any replica may answer
# The routers living in this process, by Serve application: the front reads their decisions and
# where each request went. (Ray builds a router inside each process that holds a handle, from a
# copy of its module: this one is imported, not copied, so the front sees the same objects.)
ROUTERS: dict[str, "FleetRouting"] = {}


@dataclass(frozen=True)
class RouteHint:
    """What the router knows of a request: the front computes it, Ray passes it to ``rank``."""

    request_id: str
    robot_id: str = ""
    priority: str = "plan"
    pages: tuple[bytes, ...] = ()  # prefix_pages.page_keys of its prompt
    target: str | None = None  # a replica's id: a control message (stats, cancel) for that replica only


@dataclass
class ReplicaState:
    pages: ReplicaPages
    in_flight: int = 0
    routed: int = 0  # requests sent to it
    prefix_hits: int = 0  # ... of which it had served a page of the prompt that only that robot sends


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "fleet"
    imbalance_abs: int = 16
    imbalance_rel: float = 1.5
    hash_load_factor: float = 1.25
    pages_per_replica: int = 200_000


@dataclass
class FleetRouting:
    """The router's state: per replica its pages and loads, per robot its last replica."""

    config: RoutingConfig = field(default_factory=RoutingConfig)
    replicas: dict[str, ReplicaState] = field(default_factory=dict)
    last_replica: dict[str, str] = field(default_factory=dict)  # robot -> replica of its last request
    decisions: Counter = field(default_factory=Counter)  # reason -> requests
    moves: int = 0  # a robot's request sent to another replica than its previous one
    placed: dict[str, str] = field(default_factory=dict)  # request id -> replica, while in flight
    page_owner: OrderedDict = field(default_factory=OrderedDict)  # page -> its one robot, or SHARED (LRU)
    lock: threading.RLock = field(default_factory=threading.RLock)  # Ray's router thread and the front's
    _intent: dict[str, tuple[str, str]] = field(default_factory=dict)  # request id -> (replica, reason)
    _intended: Counter = field(default_factory=Counter)  # replica -> requests ranked for it, not yet routed
    _in_flight: dict[str, tuple[str, str]] = field(default_factory=dict)  # Ray's request id -> (replica, ours)

    # --- replicas ----------------------------------------------------------------------------

    def set_replicas(self, replica_ids: list[str]) -> None:
        """The replicas now running: new ones start empty, gone ones are forgotten (a restarted
        replica comes back under a new id with an empty cache)."""
        with self.lock:
            for rid in replica_ids:
                if rid not in self.replicas:
                    self.replicas[rid] = ReplicaState(ReplicaPages(self.config.pages_per_replica))
            for gone in set(self.replicas) - set(replica_ids):
                del self.replicas[gone]
                self.last_replica = {robot: r for robot, r in self.last_replica.items() if r != gone}

    # --- choosing ----------------------------------------------------------------------------

    def rank(self, candidates: list[str], hint: RouteHint) -> list[list[str]] | None:
        """Candidates best first, one per rank (None: the pow2 policy, Ray's own)."""
        with self.lock:
            if hint.target == ANY_REPLICA:
                return [candidates]
            if hint.target is not None:
                return [[hint.target]] if hint.target in candidates else []
            if self.config.policy == "pow2":
                return None
            if any(c not in self.replicas for c in candidates):  # a replica new to this router
                self.set_replicas(sorted(set(self.replicas) | set(candidates)))
            if self.config.policy == "hash":
                chosen, reason = self._by_hash(candidates, hint), "hash"
            else:
                chosen, reason = self._by_fleet(candidates, hint)
            self._chosen(hint.request_id, (chosen, reason))
            rest = sorted((c for c in candidates if c != chosen), key=self._load)
            return [[chosen]] + [[c] for c in rest]

    def _chosen(self, request_id: str, intent: tuple[str, str] | None) -> tuple[str, str] | None:
        """Record (or, None, drop) where ``request_id`` is meant to go; returns the previous
        intent. Ray ranks a burst of requests before the first is routed: an intended replica
        counts as loaded already, or the whole burst would go to one."""
        previous = self._intent.pop(request_id, None)
        if previous is not None:
            self._intended[previous[0]] -= 1
        if intent is not None:
            self._intent[request_id] = intent
            self._intended[intent[0]] += 1
        return previous

    def _load(self, replica: str) -> int:
        return self.replicas[replica].in_flight + self._intended[replica]

    def _least_loaded(self, candidates: list[str]) -> str:
        return min(candidates, key=lambda c: (self._load(c), c))

    def _by_fleet(self, candidates: list[str], hint: RouteHint) -> tuple[str, str]:
        loads = [self._load(c) for c in candidates]
        if max(loads) - min(loads) > self.config.imbalance_abs and max(loads) > self.config.imbalance_rel * min(loads):
            return self._least_loaded(candidates), "imbalance"
        matches = {c: self._own_pages(hint, self.replicas[c].pages.match(hint.pages)) for c in candidates}
        best = max(matches.values())
        tied = [c for c in candidates if matches[c] == best]
        if hint.priority == "safety":
            return self._least_loaded(tied), "safety"
        if len(tied) == 1:
            return tied[0], "prefix"
        previous = self.last_replica.get(hint.robot_id)
        if hint.robot_id and previous in tied:
            return previous, "robot"
        return self._least_loaded(tied), "new"

    def _own_pages(self, hint: RouteHint, n: int) -> int:
        """Of the request's first ``n`` pages, those only its robot has sent."""
        return sum(1 for key in hint.pages[:n] if self.page_owner.get(key) == hint.robot_id)

    def _note_owner(self, keys: tuple[bytes, ...], robot: str) -> None:
        for key in keys:
            owner = self.page_owner.get(key)
            self.page_owner[key] = robot if owner in (None, robot) else SHARED
            self.page_owner.move_to_end(key)
        while len(self.page_owner) > 4 * self.config.pages_per_replica:
            self.page_owner.popitem(last=False)

    def _by_hash(self, candidates: list[str], hint: RouteHint) -> str:
        ring = sorted((_point(f"{c}#{i}"), c) for c in candidates for i in range(RING_POINTS))
        start = bisect.bisect(ring, (_point(hint.robot_id or hint.request_id), ""))
        order = list(dict.fromkeys(c for _, c in ring[start:] + ring[:start]))
        cap = math.ceil(self.config.hash_load_factor * (sum(map(self._load, candidates)) + 1) / len(candidates))
        return next((c for c in order if self._load(c) < cap), order[0])

    # --- what happened -----------------------------------------------------------------------

    def routed(self, hint: RouteHint, replica: str, internal_id: str) -> None:
        """The request went to ``replica``: count it, remember its pages and robot."""
        with self.lock:
            if hint.target is not None:
                return
            if replica not in self.replicas:
                self.set_replicas(sorted(set(self.replicas) | {replica}))
            state = self.replicas[replica]
            state.in_flight += 1
            state.routed += 1
            self._in_flight[internal_id] = (replica, hint.request_id)
            self.placed[hint.request_id] = replica
            hit = self._own_pages(hint, state.pages.match(hint.pages))
            if hit:
                state.prefix_hits += 1
            state.pages.insert(hint.pages)
            self._note_owner(hint.pages, hint.robot_id)
            intended, reason = self._chosen(hint.request_id, None) or (replica, self.config.policy)
            self.decisions[reason if intended == replica else "spill"] += 1
            if hint.robot_id:
                previous = self.last_replica.get(hint.robot_id)
                self.moves += previous is not None and previous != replica
                self.last_replica[hint.robot_id] = replica

    def completed(self, internal_id: str) -> None:
        with self.lock:
            replica, request_id = self._in_flight.pop(internal_id, (None, None))
            self.placed.pop(request_id, None)
            if replica in self.replicas:
                self.replicas[replica].in_flight -= 1

    def forget(self, request_id: str) -> None:
        """``request_id`` ended at the front: a replica it was ranked for but never routed to
        (Ray failed or dropped it before routing) no longer counts it as load."""
        with self.lock:
            self._chosen(request_id, None)

    def replica_of(self, request_id: str) -> str | None:
        """The replica a request in flight went to."""
        with self.lock:
            return self.placed.get(request_id)

    def snapshot(self) -> dict:
        """Per replica its load, requests routed and prefix hits; the decisions by reason."""
        with self.lock:
            return {
                "policy": self.config.policy,
                "replicas": {rid: {"in_flight": s.in_flight, "routed": s.routed, "prefix_hits": s.prefix_hits,
                                   "pages": len(s.pages)} for rid, s in sorted(self.replicas.items())},
                "decisions": dict(self.decisions),
                "moves": self.moves,
            }


def _point(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
