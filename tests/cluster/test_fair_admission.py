"""Fair admission at the cluster front, without Ray: ``FairDispatch``'s choices, and a
``ClusterFront`` whose replicas are a stand-in handle that holds each request until the test
releases it, so the order in which requests reach the replicas is what is checked."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from cloudd.cluster.fair_dispatch import FairDispatch
from cloudd.cluster.front import ClusterFront
from shared.protocol.codec import decode, encode
from shared.protocol.messages import Chunk, Error, ErrorCode, Generate, Priority, Result, Sampling, Usage
from shared.transport.client import FleetClient, RequestFailed
from shared.transport.request_front import FrontConfig

WAIT_S = 30.0  # how long a condition may take to come true before the test fails (never a timing check)


def test_a_flooding_robot_waits_behind_robots_holding_less():
    fair: FairDispatch[str] = FairDispatch()
    for i in range(6):
        fair.add(f"f{i}", "flood", Priority.PLAN, f"f{i}")
    assert fair.take(capacity=4) == ["f0", "f1", "f2", "f3"]  # alone, it gets the whole cluster
    fair.add("l0", "light", Priority.BACKGROUND, "l0")
    fair.add("l1", "light", Priority.PLAN, "l1")
    assert fair.take(capacity=4) == []  # full
    fair.ended("f0")
    assert fair.take(capacity=4) == ["l1"]  # the robot holding fewer goes first, its most urgent first
    fair.ended("f1")
    assert fair.take(capacity=4) == ["l0"]
    fair.ended("f2")
    assert fair.take(capacity=4) == ["f4"]  # nobody else waits: the flooder takes the free slot
    assert fair.in_flight == {"flood": 2, "light": 2}
    assert fair.snapshot() == {"in_flight": 4, "waiting": 1, "robots_waiting": 1}


def test_safety_never_waits_and_a_withdrawn_request_never_goes():
    fair: FairDispatch[str] = FairDispatch()
    for i in range(3):
        fair.add(f"f{i}", "flood", Priority.PLAN, f"f{i}")
    assert fair.take(capacity=2) == ["f0", "f1"]
    fair.add("stop", "other", Priority.SAFETY, "stop")
    assert fair.take(capacity=2) == ["stop"]  # past capacity
    assert fair.withdraw("f2") == "f2" and fair.withdraw("f2") is None and fair.withdraw("f0") is None
    for done in ("f0", "f1", "stop"):
        fair.ended(done)
    assert fair.take(capacity=2) == [] and fair.total == 0 and not fair.in_flight
    fair.add("x", "a", Priority.PLAN, "x")
    with pytest.raises(ValueError, match="already held"):
        fair.add("x", "b", Priority.PLAN, "x")


class HeldReplicas:
    """A stand-in for the replicas' Serve handle: each ``generate`` is recorded as it reaches a
    replica and waits until ``release``; then it answers with one chunk and its result."""

    def __init__(self) -> None:
        self.dispatched: list[str] = []  # request ids, in the order they reached a replica
        self.fail_once: set[str] = set()  # these answer an error at once, their streams ending on "<id>#end"
        self._gates: dict[str, asyncio.Event] = {}
        self._lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None

    def options(self, method_name: str, stream: bool = False) -> HeldReplicas:
        assert method_name == "generate" and stream
        return self

    async def remote(self, hint, payload: bytes) -> AsyncIterator[list[bytes]]:
        msg = decode(payload)
        gate = asyncio.Event()
        failing = msg.request_id in self.fail_once
        self.fail_once.discard(msg.request_id)
        with self._lock:
            self.loop = asyncio.get_running_loop()
            self._gates[msg.request_id + ("#end" if failing else "")] = gate
            self.dispatched.append(msg.request_id)
        if failing:  # as over Ray: the error arrives, the stream's end a little later
            yield [encode(Error(ErrorCode.REJECTED, "try again", msg.request_id))]
            await gate.wait()
            return
        await gate.wait()
        yield [encode(Chunk(msg.request_id, 0, (7,), "x")),
               encode(Result(msg.request_id, "x", "length", Usage(3, 1), token_ids=(7,)))]

    def release(self, request_id: str) -> None:
        """Let ``request_id`` answer, once it has reached a replica."""
        deadline = time.monotonic() + WAIT_S
        while request_id not in self._gates:
            assert time.monotonic() < deadline, f"{request_id} never reached a replica: {self.dispatched}"
            time.sleep(0.01)
        with self._lock:
            gate = self._gates[request_id]
        self.loop.call_soon_threadsafe(gate.set)

    def wait_for(self, count: int) -> list[str]:
        """The dispatched ids once there are ``count`` (the front dispatches on its own threads)."""
        deadline = time.monotonic() + WAIT_S
        while len(self.dispatched) < count:
            assert time.monotonic() < deadline, f"only {self.dispatched} reached the replicas"
            time.sleep(0.01)
        with self._lock:
            return list(self.dispatched)


def settled(front: ClusterFront) -> bool:
    """Whether the front has counted every request's end (it hears of one just after its result)."""
    deadline = time.monotonic() + WAIT_S
    while front.fair.total or front.fair.waiting:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def held() -> Iterator[tuple[HeldReplicas, ClusterFront, FleetClient]]:
    replicas = HeldReplicas()
    front = ClusterFront(replicas, "test-fair", FrontConfig("cluster test", ("tcp://127.0.0.1:0",),
                                                            shutdown_grace_s=0.0),
                         resume_retries=0, model_name="m", replicas=2, dispatch_per_replica=2)
    loop = threading.Thread(target=front.serve_forever, daemon=True)
    loop.start()
    with FleetClient(front.endpoint) as client:
        yield replicas, front, client
    front.stop()
    loop.join(WAIT_S)


def ask(robot: str, i: int, priority: Priority = Priority.PLAN) -> Generate:
    return Generate(f"{robot}-{i}", prompt_ids=(1, 2, 3), robot_id=robot, priority=priority,
                    sampling=Sampling(max_tokens=1))


def test_a_robot_flooding_the_cluster_front_gets_no_more_than_its_share(held):
    replicas, front, client = held
    flood = [client.start(ask("flood", i)) for i in range(10)]
    assert replicas.wait_for(4) == [f"flood-{i}" for i in range(4)]  # 2 replicas x 2: the rest wait at the front
    light = [client.start(ask("light", i)) for i in range(2)]
    stop = client.start(ask("other", 0, Priority.SAFETY))
    assert replicas.wait_for(5)[4] == "other-0"  # safety passes the full cluster at once
    replicas.release("other-0")  # (it counted: the cluster is full again once it ends)
    for i, expected in ((0, "light-0"), (1, "light-1"), (2, "flood-4")):
        replicas.release(f"flood-{i}")  # a slot frees: the robot holding the fewest takes it
        assert replicas.wait_for(6 + i)[5 + i] == expected
    for rid in ("flood-3", "light-0", "light-1", *(f"flood-{i}" for i in range(4, 10))):
        replicas.release(rid)
    results = [c.result(WAIT_S) for c in [*flood, *light, stop]]
    assert [r.request_id for r in results] == [f"flood-{i}" for i in range(10)] + ["light-0", "light-1", "other-0"]
    assert all(r.finish_reason == "length" and r.token_ids == (7,) for r in results)
    assert sorted(replicas.dispatched) == sorted(r.request_id for r in results)  # each reached a replica once
    assert settled(front)


def test_a_request_cancelled_while_waiting_at_the_front_never_reaches_a_replica(held):
    replicas, front, client = held
    calls = [client.start(ask("flood", i)) for i in range(5)]
    replicas.wait_for(4)
    cancelled = client.cancel("flood-4", WAIT_S)
    assert cancelled.finish_reason == "abort" and cancelled.detail == "cancelled"
    for i in range(4):
        replicas.release(f"flood-{i}")
    assert [c.result(WAIT_S).finish_reason for c in calls[:4]] == ["length"] * 4
    assert "flood-4" not in replicas.dispatched and settled(front)


def test_a_retry_right_after_an_error_is_a_new_request_to_fair_admission(held):
    replicas, front, client = held
    replicas.fail_once.add("flaky-0")
    with pytest.raises(RequestFailed) as failed:
        client.start(ask("flaky", 0)).result(WAIT_S)
    assert failed.value.error.code is ErrorCode.REJECTED
    retry = client.start(ask("flaky", 0))  # while the first execution's stream has not ended yet
    replicas.release("flaky-0")
    assert retry.result(WAIT_S).finish_reason == "length"
    assert replicas.dispatched == ["flaky-0", "flaky-0"]
    replicas.release("flaky-0#end")
    assert settled(front)
