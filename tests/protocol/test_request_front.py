"""The request front every daemon shares (shared.transport.request_front), over real ZeroMQ
sockets on loopback, with a lane of its own: a counting lane that "generates" one token per turn.
What holds here holds for cloudd, edged and the cluster front, whose lanes are the engine, the
local lane and escalation, and the replicas."""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from shared.protocol.codec import decode, encode
from shared.protocol.messages import (
    Cancel, Chunk, Error, ErrorCode, Generate, Health, Message, Result, Sampling, Stats, Usage,
)
from shared.transport.curve import Caller, ClientCurve, create_keys
from shared.transport.preparing import Admitting
from shared.transport.quota import QuotaConfig
from shared.transport.request_front import FrontConfig, Lane, Refused, RequestFront
from tests.serving_thread import serving_thread

BAD_TOKEN = 0  # a prompt holding it fails preparing (the request's fault)
REFUSED_TOKEN = 1  # a prompt holding it is refused by the lane at start


class CountingLane(Lane[list[int]]):
    """Each running request gets one token (its count so far) per turn, until max_tokens."""

    def __init__(self, config: FrontConfig, context: zmq.Context | None = None):
        self.running: dict[str, tuple[Generate, int]] = {}  # id -> (request, tokens made)
        self.started: list[str] = []
        self.robots: list[str] = []
        self.hold = threading.Event()  # cleared: the lane's turn blocks (a long engine step)
        self.hold.set()
        self.front: RequestFront[list[int]] = RequestFront(self, config, context)

    def refusal(self, msg: Generate) -> Error | None:
        return Error(ErrorCode.REJECTED, "overloaded", msg.request_id) if msg.priority.value == "background" else None

    def prepare(self, msg: Generate) -> list[int]:
        if BAD_TOKEN in msg.prompt_ids:
            raise ValueError("token 0 is not servable")
        return list(msg.prompt_ids)

    def prepares_here(self, size: int) -> bool:
        return True

    def start(self, pending: Admitting, prepared: list[int]) -> None:
        if REFUSED_TOKEN in prepared:
            raise Refused(Error(ErrorCode.DEADLINE, "cannot start in time", pending.msg.request_id))
        self.running[pending.msg.request_id] = (pending.msg, 0)
        self.started.append(pending.msg.request_id)
        self.robots.append(pending.msg.robot_id)

    def cancelled_before_start(self, request_id: str, prepared: list[int]) -> Result:
        return Result(request_id, "", "abort", Usage(len(prepared), 0))

    def cancel(self, request_id: str) -> None:
        msg, made = self.running.pop(request_id)
        self.front.finish(request_id, Result(request_id, "", "abort", Usage(len(msg.prompt_ids), made)))

    def cancel_all(self, why: str) -> None:
        for request_id in list(self.running):
            self.cancel(request_id)

    def stats(self, caller: Caller, reply: Callable[[dict | Error], None]) -> None:
        reply({"running": sorted(rid for rid, (msg, _) in self.running.items()
                                 if caller.robot is None or msg.robot_id == caller.robot)})

    def wait_ms(self) -> int:
        return 5 if self.running else 50

    def work(self) -> None:
        self.hold.wait()
        for request_id, (msg, made) in list(self.running.items()):
            if msg.sampling.max_tokens == 1_000:  # runs until cancelled
                continue
            self.front.emit(request_id, [made], f"t{made} ")
            made += 1
            self.running[request_id] = (msg, made)
            if made == msg.sampling.max_tokens:
                del self.running[request_id]
                entry = self.front.live(request_id)
                self.front.finish(request_id, Result(request_id, "".join(entry.text), "length",
                                                     Usage(len(msg.prompt_ids), made), tuple(entry.token_ids)))


@contextlib.contextmanager
def running(config: FrontConfig, context: zmq.Context | None = None) -> Iterator[CountingLane]:
    """The lane's loop on a thread; once it has drained, no request is left counted in flight."""
    lane = CountingLane(config, context)
    with serving_thread(lane, join_timeout_s=10):
        try:
            yield lane
        finally:
            lane.hold.set()
    lane.front.check_integrity()
    assert len(lane.front.in_flight) == 0


class Peer:
    def __init__(self, endpoint: str, curve: ClientCurve | None = None, context: zmq.Context | None = None):
        self.sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self.sock)
        self.sock.connect(endpoint)

    def send(self, msg: Message) -> None:
        self.sock.send(encode(msg))

    def recv(self, timeout_s: float = 10.0) -> Message:
        if not self.sock.poll(timeout_s * 1000):
            raise TimeoutError("no reply")
        return decode(self.sock.recv())

    def until_end(self) -> tuple[list[Chunk], Result | Error]:
        chunks = []
        while isinstance(reply := self.recv(), Chunk):
            chunks.append(reply)
        return chunks, reply


def gen(request_id: str, max_tokens: int = 3, prompt: tuple[int, ...] = (5, 6, 7), **kw) -> Generate:
    return Generate(request_id, prompt_ids=prompt, sampling=Sampling(max_tokens=max_tokens), **kw)


def config(**kw) -> FrontConfig:
    return FrontConfig(daemon="testd", endpoints=("tcp://127.0.0.1:0",), **kw)


@pytest.fixture(scope="module")
def lane() -> Iterator[CountingLane]:
    with running(config()) as lane:
        yield lane


@pytest.fixture
def peer(lane) -> Iterator[Peer]:
    p = Peer(lane.front.endpoints[0])
    yield p
    p.sock.close()


def test_a_stream_gets_its_chunks_in_order_then_its_result(peer):
    peer.send(gen("s1", stream=True))
    chunks, result = peer.until_end()
    assert [c.seq for c in chunks] == [0, 1, 2] and [c.token_ids for c in chunks] == [(0,), (1,), (2,)]
    assert isinstance(result, Result) and result.text == "t0 t1 t2 " and result.token_ids == (0, 1, 2)


def test_a_retry_joins_the_running_request_and_later_gets_the_kept_result(lane, peer):
    other = Peer(lane.front.endpoints[0])
    peer.send(gen("r1", max_tokens=4))
    other.send(gen("r1", max_tokens=4))  # the same request again: joins it
    _, first = peer.until_end()
    _, second = other.until_end()
    peer.send(gen("r1", max_tokens=4))  # after it finished: the kept result
    _, third = peer.until_end()
    assert first == second == third and lane.started.count("r1") == 1
    other.sock.close()


def test_a_different_request_under_a_used_id_is_refused(peer):
    peer.send(gen("u1"))
    peer.until_end()
    peer.send(gen("u1", max_tokens=5))
    reply = peer.recv()
    assert isinstance(reply, Error) and reply.code is ErrorCode.INVALID_REQUEST and "in use" in reply.message


def test_a_cancel_ends_a_running_request_for_its_sender_and_the_canceller(lane, peer):
    canceller = Peer(lane.front.endpoints[0])
    peer.send(gen("c1", max_tokens=1_000))
    while "c1" not in lane.started:
        canceller.send(Stats())
        canceller.recv()
    canceller.send(Cancel("c1"))
    assert canceller.recv().finish_reason == "abort"
    assert peer.until_end()[1].finish_reason == "abort"
    canceller.send(Cancel("no-such-request"))
    reply = canceller.recv()
    assert isinstance(reply, Error) and reply.code is ErrorCode.NOT_FOUND
    canceller.sock.close()


@pytest.mark.parametrize(("request_", "code"), [
    (gen("bad-prompt", prompt=(5, BAD_TOKEN)), ErrorCode.INVALID_REQUEST),  # preparing failed
    (gen("refused-at-start", prompt=(5, REFUSED_TOKEN)), ErrorCode.DEADLINE),  # the lane's start refused it
    (gen("refused-on-arrival", priority="background"), ErrorCode.REJECTED),  # the lane's admission refused it
])
def test_a_request_the_lane_cannot_run_is_answered_and_never_started(lane, peer, request_, code):
    rejected = lane.front.counters.rejected
    peer.send(request_)
    reply = peer.recv()
    assert isinstance(reply, Error) and reply.code is code and request_.request_id not in lane.started
    assert lane.front.counters.rejected == rejected + 1
    assert lane.front.live(request_.request_id) is None  # a retry may run it anew


def test_a_reply_message_sent_as_a_request_is_refused(peer):
    peer.send(Health("ok"))  # answered by the socket's thread: health is a probe either way
    assert isinstance(peer.recv(), Health)
    peer.send(Result("x", "", "stop", Usage(0, 0)))
    reply = peer.recv()
    assert isinstance(reply, Error) and reply.code is ErrorCode.BAD_MESSAGE


def test_health_is_answered_during_a_long_turn_and_says_stalled(tmp_path):
    with running(config(stall_after_s=0.05)) as lane:
        peer = Peer(lane.front.endpoints[0])
        peer.send(gen("warm"))
        peer.until_end()
        lane.hold.clear()  # the next turn blocks, as a long engine step would
        peer.send(gen("blocked"))
        states = set()
        while "stalled" not in states:
            peer.send(Health())
            states.add(peer.recv().status)
        lane.hold.set()
        assert peer.until_end()[1].finish_reason == "length"
        peer.sock.close()


def test_a_robot_over_its_quota_is_told_when_to_retry():
    with running(config(robot_quota=QuotaConfig(requests_per_s=0.001, burst=1))) as lane:
        peer = Peer(lane.front.endpoints[0])
        peer.send(gen("q1", robot_id="amr-7"))
        assert isinstance(peer.until_end()[1], Result)
        peer.send(gen("q2", robot_id="amr-7"))
        reply = peer.recv()
        assert isinstance(reply, Error) and reply.code is ErrorCode.REJECTED and reply.retry_after_ms > 0
        peer.send(gen("q3", robot_id="amr-8"))  # another robot's quota is its own
        assert isinstance(peer.until_end()[1], Result)
        peer.sock.close()


def test_shutdown_answers_the_running_request_after_the_grace():
    with running(config(shutdown_grace_s=2.0)) as lane:
        peer = Peer(lane.front.endpoints[0])
        peer.send(gen("long", max_tokens=1_000))
        while "long" not in lane.started:
            peer.send(Stats())
            peer.recv()
        lane.stop()
        status = None
        while status != "draining":
            peer.send(Health())
            status = peer.recv().status
        peer.send(gen("late"))
        late = peer.recv()
        assert isinstance(late, Error) and late.code is ErrorCode.REJECTED and "testd is shutting down" in late.message
        assert peer.recv().finish_reason == "abort"  # "long", cancelled once the grace ran out
        peer.sock.close()


def curve_keys(tmp_path: Path, robots: tuple[str, ...]) -> dict:
    """Keys for ``robots``, an operator ``ops`` and the daemon ``testd`` under ``tmp_path``
    (secrets in ``secrets/``); the front's CURVE settings."""
    for folder, names in (("robots", robots), ("operators", ("ops",)), ("server", ("testd",))):
        (tmp_path / folder).mkdir()
        for name in names:
            public, _ = create_keys(tmp_path / "secrets", name)
            shutil.copy(public, tmp_path / folder)
    return dict(curve_secret_key=str(tmp_path / "secrets" / "testd.key_secret"),
                curve_authorized_dir=str(tmp_path / "robots"), curve_operator_dir=str(tmp_path / "operators"))


def test_with_curve_a_robot_acts_as_itself(tmp_path: Path):
    keys = curve_keys(tmp_path, ("amr-001", "amr-002"))
    context = zmq.Context()  # one ZAP authenticator per context
    with running(config(**keys), context) as lane:
        def peer(name: str) -> Peer:
            curve = ClientCurve.from_files(tmp_path / "server" / "testd.key", tmp_path / "secrets" / f"{name}.key_secret")
            return Peer(lane.front.endpoints[0], curve, context)

        one, two, ops = peer("amr-001"), peer("amr-002"), peer("ops")
        one.send(gen("amr-002/x"))  # another robot's namespace
        reply = one.recv()
        assert isinstance(reply, Error) and reply.code is ErrorCode.INVALID_REQUEST
        one.send(gen("amr-001/a", max_tokens=1_000, robot_id="amr-002"))  # claims another robot_id
        while "amr-001/a" not in lane.started:
            ops.send(Stats())
            ops.recv()
        assert lane.robots[-1] == "amr-001"  # served as its key's robot
        two.send(Stats())
        assert two.recv().values == {"running": []}  # it sees only its own
        two.send(Cancel("amr-001/a"))
        reply = two.recv()
        assert isinstance(reply, Error) and reply.code is ErrorCode.NOT_FOUND  # another's does not exist for it
        ops.send(Cancel("amr-001/a"))  # an operator stops anything
        assert ops.recv().finish_reason == "abort" and one.recv().finish_reason == "abort"
        for p in (one, two, ops):
            p.sock.close()
    context.term()


def test_after_a_restart_a_retry_of_a_request_that_ended_gets_its_kept_result_and_does_not_run_again(tmp_path):
    """Found by make soak on a Xeon: a request that ended but whose answer was not yet sent when
    the daemon died ran again when the robot resent it (the ledger lived in memory only)."""
    journal = str(tmp_path / "executions.jsonl")
    with running(config(execution_log=journal)) as first:
        peer = Peer(first.front.endpoints[0])
        peer.send(gen("amr-1/x", stream=True, robot_id="amr-1"))
        _, answer = peer.until_end()
        peer.sock.close()
    with running(config(execution_log=journal)) as second:  # the next incarnation, on another port
        peer = Peer(second.front.endpoints[0])
        peer.send(gen("amr-1/x", stream=True, robot_id="amr-1", resume_from=1))  # the robot resends it
        assert peer.recv() == answer and second.started == []  # answered from the journal, not run
        peer.send(gen("amr-1/x", max_tokens=7))  # another request under its id
        reply = peer.recv()
        assert isinstance(reply, Error) and reply.code is ErrorCode.INVALID_REQUEST
        peer.send(Cancel("amr-1/x"))  # a cancel of a finished request gets its result
        assert peer.recv() == answer
        peer.sock.close()
