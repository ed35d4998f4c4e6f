"""cloudd's core loop in-process with the tiny model, over real ZeroMQ sockets on loopback:
bad input, idempotent retries, stream resumption, cancel, deadlines, overload, shutdown."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloudd.server import CloudServer, ServeConfig
from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.policy import FleetPolicy
from shared.protocol.codec import decode, encode
from shared.protocol.messages import (
    PROTOCOL_VERSION,
    Cancel,
    ChatMessage,
    Chunk,
    Error,
    ErrorCode,
    Generate,
    Health,
    Message,
    Result,
    Sampling,
    Stats,
    Usage,
)
from shared.transport.client import ClientConfig, FleetClient, RequestFailed
from shared.transport.router import MAX_FRAME_BYTES
from tests.engine.tiny import greedy_reference, tiny_model
from tests.serving_thread import serving_thread

MODEL = tiny_model(tie_word_embeddings=False)
PROMPT = (5, 9, 2, 77, 31, 8, 8, 1, 40)


@contextlib.contextmanager
def running_server(**serve) -> Iterator[CloudServer]:
    """A CloudServer with the tiny model in a thread; stopped (drained) on exit."""
    engine = Engine(MODEL, None, EngineConfig(block_size=4, num_blocks=512), policy=FleetPolicy())
    server = CloudServer(engine, ServeConfig(zmq_port=0, **serve), "tiny")
    with serving_thread(server, join_timeout_s=10):
        yield server


@pytest.fixture(scope="module")
def server() -> Iterator[CloudServer]:
    with running_server() as srv:
        yield srv


class Peer:
    """A raw DEALER socket: send any bytes, read decoded replies."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, msg: Message | bytes) -> None:
        self.sock.send(msg if isinstance(msg, bytes) else encode(msg))

    def recv(self, timeout_s: float = 5.0) -> Message:
        if not self.sock.poll(timeout_s * 1000):
            raise TimeoutError("no reply")
        return decode(self.sock.recv())

    def until_result(self, timeout_s: float = 10.0) -> tuple[list[Chunk], Result | Error]:
        chunks = []
        while True:
            msg = self.recv(timeout_s)
            if isinstance(msg, Chunk):
                chunks.append(msg)
            else:
                return chunks, msg

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def peer(server) -> Iterator[Peer]:
    p = Peer(server.endpoint)
    yield p
    p.close()


def gen(rid: str, max_tokens: int = 6, prompt=PROMPT, **kw) -> Generate:
    return Generate(rid, prompt_ids=tuple(prompt), sampling=Sampling(max_tokens=max_tokens, ignore_eos=True), **kw)


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("payload, code", [
    (b"\xc1\xff garbage", ErrorCode.BAD_MESSAGE),
    (msgpack.packb({"v": 99, "type": "health"}), ErrorCode.BAD_VERSION),
    (msgpack.packb({"v": PROTOCOL_VERSION, "type": "launch_rockets"}), ErrorCode.UNKNOWN_TYPE),
    (msgpack.packb({"v": PROTOCOL_VERSION, "type": "generate", "request_id": "x"}), ErrorCode.BAD_MESSAGE),
    (msgpack.packb({"v": PROTOCOL_VERSION, "type": "cancel", "request_id": 7}), ErrorCode.BAD_MESSAGE),
    (b"\x00" * (2 << 20), ErrorCode.TOO_LARGE),
])
def test_bad_input_gets_an_error_reply_and_the_server_keeps_serving(peer, payload, code):
    peer.send(payload)
    reply = peer.recv()
    assert isinstance(reply, Error) and reply.code is code
    peer.send(Health())
    assert peer.recv() == Health("ok")


def test_a_frame_past_the_transport_limit_is_dropped_unread_and_the_server_keeps_serving(server):
    """Found in review: with no ZeroMQ message-size limit a 1 GiB frame was received whole
    before the too_large reply."""
    assert server.socket.getsockopt(zmq.MAXMSGSIZE) == MAX_FRAME_BYTES
    sender = Peer(server.endpoint)
    sender.send(b"\x00" * (MAX_FRAME_BYTES + 1))
    other = Peer(server.endpoint)
    other.send(Health())
    assert other.recv() == Health("ok")
    sender.close(), other.close()


@pytest.mark.parametrize("sent", [Chunk("r", 0, (1,), "x"), Error(ErrorCode.DEADLINE, "made up", "r")])
def test_a_reply_message_sent_as_a_request_is_refused(peer, sent):
    """An ``error`` too (found by fuzzing cloudd serve: it came back as sent, as if it were the answer)."""
    peer.send(sent)
    reply = peer.recv()
    assert isinstance(reply, Error) and reply.code is ErrorCode.BAD_MESSAGE and reply.request_id == "r"
    assert "is a reply, not a request" in reply.message


def test_extra_frames_are_refused(peer):
    peer.sock.send_multipart([b"a", b"b"])
    reply = peer.recv()
    assert isinstance(reply, Error) and reply.code is ErrorCode.BAD_MESSAGE


@pytest.mark.parametrize("request_, words", [
    (Generate("bad-sampling", prompt_ids=PROMPT, sampling=Sampling(top_p=0.0)), "top_p"),
    (Generate("bad-token", prompt_ids=(5, 1000)), "token ids"),
    (Generate("no-tokenizer", messages=(ChatMessage("user", "hi"),)), "tokenizer"),
    (Generate("formatted", prompt_ids=PROMPT, response_format={"type": "json_object"}), "tokenizer"),
    (Generate("bad-format", prompt_ids=PROMPT, response_format={"type": "yaml"}), "yaml"),
])
def test_unservable_requests_are_invalid_and_nothing_runs(peer, server, request_, words):
    peer.send(request_)
    reply = peer.recv()
    assert isinstance(reply, Error) and reply.code is ErrorCode.INVALID_REQUEST and words in reply.message
    assert request_.request_id not in server.ledger.live


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(
    st.binary(max_size=64),
    st.dictionaries(st.sampled_from(["v", "type", "request_id", "prompt_ids", "sampling", "priority", "x"]),
                    st.one_of(st.integers(-2, 2), st.text(max_size=8), st.none(), st.lists(st.integers(0, 200), max_size=4),
                              st.sampled_from(["generate", "cancel", "stats", "health", PROTOCOL_VERSION])),
                    max_size=6).map(msgpack.packb),
))
def test_fuzzed_input_always_gets_one_reply_and_never_kills_the_server(peer, data):
    peer.send(data)
    # NOTE: a fuzzed map is sometimes a valid request: then its own answer comes back.
    assert isinstance(peer.recv(timeout_s=30), Error | Result | Stats | Health)
    peer.send(Health())
    assert isinstance(peer.recv(), Health)


# --- generation ------------------------------------------------------------------------------


def test_tokens_over_the_wire_match_the_reference_generation(server):
    with FleetClient(server.endpoint) as client:
        result = client.generate(gen("ref", max_tokens=8))
    assert list(result.token_ids) == greedy_reference(MODEL, list(PROMPT), 8)
    assert result.finish_reason == "length" and result.usage.completion_tokens == 8
    assert {"ttft_s", "e2e_s", "queue_s"} <= set(result.timings)


def test_a_stream_numbers_its_chunks_and_they_add_up_to_the_result(server):
    with FleetClient(server.endpoint) as client:
        events = list(client.stream(gen("stream", max_tokens=5)))
    chunks, result = events[:-1], events[-1]
    assert [c.seq for c in chunks] == list(range(5))
    assert tuple(t for c in chunks for t in c.token_ids) == result.token_ids


def test_a_retry_attaches_to_the_running_request_and_it_runs_once(server):
    a, b = Peer(server.endpoint), Peer(server.endpoint)
    before = server.snapshot()["totals"]["requests"]
    a.send(gen("once", max_tokens=30))
    b.send(gen("once", max_tokens=30))  # another connection, the same request
    (_, ra), (_, rb) = a.until_result(), b.until_result()
    assert ra == rb and isinstance(ra, Result)
    b.send(gen("once", max_tokens=30))  # after it finished: the kept result
    assert b.until_result()[1] == ra
    assert server.snapshot()["totals"]["requests"] == before + 1
    a.close(), b.close()


def test_a_request_resumed_after_delivered_tokens_continues_them(server):
    """What a cluster front sends when a replica dies: the same request with the tokens its
    client already has; the chunks and result carry what follows, usage counts them all."""
    expected = greedy_reference(MODEL, list(PROMPT), 8)
    woken = threading.Event()
    with FleetClient(server.endpoint) as client:
        call = client.start(gen("resumed", max_tokens=8, stream=True, resume_token_ids=tuple(expected[:3])),
                            notify=woken.set)
        replies = []
        while not (replies and isinstance(replies[-1], Result)):
            assert woken.wait(30)
            woken.clear()
            replies += call.ready_replies()
    *chunks, result = replies
    assert [t for c in chunks for t in c.token_ids] == list(result.token_ids) == expected[3:]
    assert result.usage.completion_tokens == 8 and result.finish_reason == "length"


def test_another_request_under_a_used_id_is_refused(peer):
    peer.send(gen("taken", max_tokens=2))
    peer.until_result()
    peer.send(gen("taken", max_tokens=3))
    reply = peer.recv()
    assert isinstance(reply, Error) and reply.code is ErrorCode.INVALID_REQUEST and "different" in reply.message


def test_a_reconnecting_client_resumes_a_stream_from_its_last_chunk(server):
    first = Peer(server.endpoint)
    first.send(gen("resume", max_tokens=40, stream=True))
    got = [first.recv(), first.recv(), first.recv()]
    first.close()  # the link drops after three chunks
    second = Peer(server.endpoint)
    second.send(gen("resume", max_tokens=40, stream=True, resume_from=3))
    rest, result = second.until_result()
    assert [c.seq for c in got + rest] == list(range(40))
    assert tuple(t for c in got + rest for t in c.token_ids) == result.token_ids
    second.close()


def test_cancel_mid_stream_ends_it_with_abort_and_frees_its_kv(server, peer):
    peer.send(gen("cancel-me", max_tokens=500, stream=True))
    assert isinstance(peer.recv(), Chunk)
    peer.send(Cancel("cancel-me"))
    chunks, result = peer.until_result()
    assert isinstance(result, Result) and result.finish_reason == "abort"
    assert result.usage.completion_tokens < 500
    stats = server.snapshot()  # nothing else runs on this server now
    assert stats["engine"]["kv_blocks_in_requests"] == 0 and stats["running"] == []
    peer.send(Cancel("cancel-me"))  # cancelling again returns how it ended
    assert peer.recv() == result


def test_a_robot_over_its_quota_is_rejected_with_a_retry_after():
    with running_server(robot_requests_per_s=0.01, robot_burst=2) as server:
        peer = Peer(server.endpoint)
        for i in range(2):
            peer.send(gen(f"q-{i}", robot_id="amr-9"))
            assert isinstance(peer.until_result()[1], Result)
        peer.send(gen("q-2", robot_id="amr-9"))
        refused = peer.recv()
        assert isinstance(refused, Error) and refused.code is ErrorCode.REJECTED and "quota" in refused.message
        assert refused.retry_after_ms > 0
        peer.send(gen("q-3", robot_id="amr-10"))  # another robot's quota is its own
        assert isinstance(peer.until_result()[1], Result)
        peer.send(gen("q-0", robot_id="amr-9"))  # a retry of an admitted request is not charged
        assert isinstance(peer.recv(), Result)
        peer.close()


def test_a_sender_past_its_frame_rate_is_dropped_and_others_are_answered():
    with running_server(frames_per_s=0.01, frames_burst=3) as server:
        flood, other = Peer(server.endpoint), Peer(server.endpoint)
        for _ in range(10):
            flood.send(Health())
        answered = []
        while len(answered) < 3:
            answered.append(flood.recv())
        assert answered == [Health("ok")] * 3
        other.send(Health())  # its own bucket: answered
        assert other.recv() == Health("ok")
        dropped = lambda: server.metrics.registry.get_sample_value("fleetserve_frames_dropped_total")  # noqa: E731
        for _ in range(200):  # the rest of the flood may be read after the other's health
            if dropped() == 7:
                break
            time.sleep(0.05)
        assert dropped() == 7
        flood.close(), other.close()


def test_cancel_of_an_unknown_request_is_not_found(peer):
    peer.send(Cancel("never-sent"))
    reply = peer.recv()
    assert isinstance(reply, Error) and reply.code is ErrorCode.NOT_FOUND


def test_stats_and_health_answer(peer):
    peer.send(Stats())
    stats = peer.recv()
    assert isinstance(stats, Stats) and stats.values["model"] == "tiny" and stats.values["policy"] == "fleet"
    peer.send(Health())
    assert peer.recv() == Health("ok")


# --- deadlines, overload, shutdown -----------------------------------------------------------------


def test_a_running_request_is_stopped_at_its_deadline(peer):
    peer.send(gen("deadline-stop", max_tokens=1500, deadline_ms=100))
    _, result = peer.until_result()
    assert isinstance(result, Result) and result.finish_reason == "deadline"
    assert 0 < result.usage.completion_tokens < 1500


def test_a_hopeless_deadline_is_rejected_at_once_with_a_deadline_error():
    with running_server() as srv:
        srv.engine.scheduler.rate.observe(num_tokens=10, seconds=1.0)  # as if 0.1 s per token
        p = Peer(srv.endpoint)
        p.send(gen("hopeless", deadline_ms=200))  # 9 prompt tokens: ~0.9 s to the first token
        reply = p.recv()
        assert isinstance(reply, Error) and reply.code is ErrorCode.DEADLINE and reply.request_id == "hopeless"
        assert srv.snapshot()["totals"]["rejected"] == 1
        p.close()


def test_overload_is_rejected_with_a_reason():
    # one robot fills the whole queue here: its share in flight (robot_max_in_flight) is off
    with running_server(max_waiting=1, robot_max_in_flight=0) as srv:
        p = Peer(srv.endpoint)
        for i in range(6):
            p.send(gen(f"load-{i}", max_tokens=200))
        replies = [p.until_result()[1] for _ in range(6)]
        rejected = [r for r in replies if isinstance(r, Error)]
        assert rejected and all(r.code is ErrorCode.REJECTED and "overloaded" in r.message for r in rejected)
        assert any(isinstance(r, Result) for r in replies)
        p.close()


def test_shutdown_rejects_new_work_and_cancels_what_runs_with_a_reply():
    with running_server(shutdown_grace_s=0.3) as srv:
        p = Peer(srv.endpoint)
        p.send(gen("long", max_tokens=1900))
        time.sleep(0.2)
        srv.stop()
        time.sleep(0.05)
        q = Peer(srv.endpoint)
        q.send(gen("late"))
        late = q.recv()
        assert isinstance(late, Error) and late.code is ErrorCode.REJECTED
        _, result = p.until_result()
        assert isinstance(result, Result) and result.finish_reason == "abort"
        p.close(), q.close()


# --- the client's retries and heartbeats -------------------------------------------------------------


def test_the_client_retries_a_silent_daemon_with_the_same_request_id():
    """A fake daemon ignores the first generate; the client probes, reconnects, sends it again."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = FleetClient(f"tcp://127.0.0.1:{port}", ClientConfig(timeout_s=0.5, heartbeat_s=0.1, retries=2))
    call = client.start(gen("retry-me"))
    seen: list[Message] = []
    while sum(isinstance(m, Generate) for m in seen) < 2:
        assert router.poll(5000), "the client never retried"
        identity, data = router.recv_multipart()
        seen.append(decode(data))
    assert [m.request_id for m in seen if isinstance(m, Generate)] == ["retry-me", "retry-me"]
    assert any(isinstance(m, Health) for m in seen)  # heartbeats probed the silent daemon
    result = Result("retry-me", "ok", "stop", usage=Usage(9, 1))
    router.send_multipart([identity, encode(result)])
    assert call.result(timeout_s=5) == result
    client.close()
    router.close()


def test_the_client_gives_up_with_unavailable_after_its_retries():
    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = FleetClient(f"tcp://127.0.0.1:{port}", ClientConfig(timeout_s=0.2, heartbeat_s=0.05, retries=1))
    with pytest.raises(RequestFailed) as info:
        client.generate(gen("nobody-home"), timeout_s=5)
    assert info.value.code is ErrorCode.UNAVAILABLE
    client.close()
    router.close()


def test_health_says_stalled_while_one_engine_turn_runs_past_its_bound():
    """Found in review: a request could hold the engine's thread for seconds while health still
    answered ok."""
    with running_server(stall_after_s=0.2) as server:
        entered, release = threading.Event(), threading.Event()
        step = server.engine.step

        def stuck_step():
            entered.set()
            release.wait(30)
            return step()

        server.engine.step = stuck_step
        peer = Peer(server.endpoint)
        try:
            peer.send(gen("slow", max_tokens=2))
            assert entered.wait(10)
            statuses = []
            while "stalled" not in statuses and len(statuses) < 200:  # the turn passes 0.2 s while stuck
                peer.send(Health())
                statuses.append(peer.recv().status)
                release.wait(0.05)
            assert statuses[-1] == "stalled"
            server.engine.step = step
            release.set()
            peer.until_result()
            peer.send(Health())
            while isinstance(reply := peer.recv(), Result | Chunk):  # the stalled turn's late replies
                pass
            assert reply == Health("ok")
        finally:
            release.set()
            peer.close()


def test_a_request_that_fails_in_the_engine_fails_alone_and_a_retry_runs_it_again():
    """Found in review: one request's failure inside a step ended every live request with
    ``internal``."""
    with running_server() as server:
        sample, broken = server.engine.sampler.sample, threading.Event()
        broken.set()

        def faulty(logits, request_ids, params):
            if broken.is_set() and "doomed" in request_ids:
                raise RuntimeError("this request's sampling is broken")
            return sample(logits, request_ids, params)

        server.engine.sampler.sample = faulty
        a, b = Peer(server.endpoint), Peer(server.endpoint)
        sampled = Sampling(max_tokens=20, ignore_eos=True, temperature=1.0, top_k=1)  # greedy, through the sampler
        try:
            a.send(replace(gen("healthy"), sampling=sampled))
            b.send(replace(gen("doomed"), sampling=sampled))
            _, failed = b.until_result()
            _, ok = a.until_result()
            assert isinstance(failed, Error) and failed.code is ErrorCode.INTERNAL and failed.request_id == "doomed"
            assert isinstance(ok, Result) and list(ok.token_ids) == greedy_reference(MODEL, list(PROMPT), 20)
            broken.clear()
            b.send(replace(gen("doomed"), sampling=sampled))  # the retry runs anew, now without the fault
            _, retried = b.until_result()
            assert isinstance(retried, Result) and retried.token_ids == ok.token_ids
            assert server.snapshot()["totals"]["error"] == 1
        finally:
            a.close(), b.close()


# --- bookkeeping the soak harness reads ------------------------------------------------------------


def test_the_execution_journal_counts_one_run_per_request_even_when_it_is_retried(tmp_path):
    from shared.transport.execution_log import Executions, read_executions
    journal = tmp_path / "executions.jsonl"
    with running_server(execution_log=str(journal)) as srv, FleetClient(srv.endpoint) as client:
        client.generate(gen("journal-a", max_tokens=3))
        client.generate(gen("journal-a", max_tokens=3))  # a retry: the kept result, no second run
        client.generate(gen("journal-b", max_tokens=2))
    assert read_executions(journal) == {"journal-a": Executions(1, 1), "journal-b": Executions(1, 1)}


def test_stats_check_the_kv_pool_when_idle_and_name_a_leaked_block(server, peer):
    peer.send(gen("kv-check", max_tokens=4))
    peer.until_result()
    assert server.snapshot()["kv_check"] == "ok"
    pool = server.engine.scheduler.kv.pool
    leaked = pool.allocate(1)  # a ref nobody holds: what a bug in a fault path would leave
    try:
        assert server.snapshot()["kv_check"].startswith("failed: block")
    finally:
        pool.decref(leaked)
    assert server.snapshot()["kv_check"] == "ok"


# --- preparing (tokenizing, grammar checks) beside the engine's thread -----------------------------

SLOW_PROMPT = (96,) * 64 + PROMPT  # a larger frame than PROMPT's: prepared on the preparing thread


@contextlib.contextmanager
def slow_preparing(seconds: float) -> Iterator[CloudServer]:
    """A server on which frames larger than a PROMPT request's go to the preparing thread, and
    preparing a prompt that starts with token 96 takes ``seconds``."""
    with running_server() as srv:
        prepare = srv.engine.prepare

        def slow(prompt, response_format=None):
            if prompt and prompt[0] == 96:
                time.sleep(seconds)
            return prepare(prompt, response_format)

        srv.engine.prepare = slow
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("cloudd.server.PREPARE_HERE_BYTES", len(encode(gen("prep-fast", max_tokens=3))) + 8)
            yield srv


def test_while_a_large_prompt_is_prepared_small_ones_run_and_a_retry_joins_it():
    with slow_preparing(1.0) as srv:
        slow, fast, retry = Peer(srv.endpoint), Peer(srv.endpoint), Peer(srv.endpoint)
        slow.send(gen("prep-slow", max_tokens=3, prompt=SLOW_PROMPT))
        retry.send(gen("prep-slow", max_tokens=3, prompt=SLOW_PROMPT))  # joins the one being prepared
        fast.send(gen("prep-fast", max_tokens=3))
        _, fast_result = fast.until_result()
        assert isinstance(fast_result, Result) and "prep-slow" in srv.front.preparer.pending  # done meanwhile
        (_, a), (_, b) = slow.until_result(), retry.until_result()
        assert isinstance(a, Result) and a == b and list(a.token_ids) == greedy_reference(MODEL, list(SLOW_PROMPT), 3)
        assert srv.snapshot()["totals"]["requests"] == 2
        for p in (slow, fast, retry):
            p.close()


def test_a_cancel_while_a_request_is_prepared_ends_it_before_it_runs():
    with slow_preparing(1.0) as srv:
        peer = Peer(srv.endpoint)
        peer.send(gen("prep-cancel", max_tokens=3, prompt=SLOW_PROMPT))
        peer.send(Cancel("prep-cancel"))
        first, second = peer.recv(), peer.recv()
        assert first == second and isinstance(first, Result) and first.finish_reason == "abort"
        assert first.usage.completion_tokens == 0 and srv.snapshot()["totals"]["requests"] == 0
        peer.close()


def test_a_deadline_counts_from_arrival_not_from_when_the_prompt_was_prepared():
    with slow_preparing(0.5) as srv:
        peer = Peer(srv.endpoint)
        peer.send(gen("prep-late", max_tokens=3, prompt=SLOW_PROMPT, deadline_ms=200))
        reply = peer.recv()
        assert isinstance(reply, Error) and reply.code is ErrorCode.DEADLINE
        peer.close()


def test_token_ids_past_max_model_len_are_refused_before_they_are_prepared():
    """Found in review: frames of 131,072 prompt_ids (or resume_token_ids) were decoded and
    prepared before the engine refused them, stalling every other robot for seconds."""
    with running_server() as srv:
        prepared = []
        prepare = srv.engine.prepare
        srv.engine.prepare = lambda prompt, response_format=None: prepared.append(1) or prepare(prompt, response_format)
        limit = srv.engine.scheduler.config.max_model_len
        peer = Peer(srv.endpoint)
        for request_ in (gen("huge", prompt=[7] * limit), Generate("huge-resume", prompt_ids=PROMPT,
                                                                     resume_token_ids=(7,) * limit)):
            peer.send(request_)
            reply = peer.recv()
            assert isinstance(reply, Error) and reply.code is ErrorCode.INVALID_REQUEST
            assert "max_model_len" in reply.message
        peer.send(gen("longer", prompt=[7] * (limit + 1)))  # refused as the frame is read: the id still comes back
        reply = peer.recv()
        assert isinstance(reply, Error) and reply.code is ErrorCode.TOO_LARGE and reply.request_id == "longer"
        peer.send(gen("fits"))
        assert isinstance(peer.until_result()[1], Result) and prepared == [1]
        peer.close()
