"""Admission charges what a request costs (issue 48, findings 5 and 6): its prompt's tokens as
well as its max_tokens, and no robot holds more than its share of the daemon's queue."""

from __future__ import annotations

from shared.protocol.messages import Error, ErrorCode, Result, Stats
from shared.transport.quota import QuotaConfig
from tests.protocol.test_request_front import Peer, config, gen, running


def test_a_long_prompt_is_charged_its_tokens_not_only_its_max_tokens():
    """A minute's quota of 100 tokens: a 200-token prompt asking for 3 more never fits it."""
    with running(config(robot_quota=QuotaConfig(tokens_per_min=100))) as lane:
        peer = Peer(lane.front.endpoints[0])
        peer.send(gen("long", max_tokens=3, prompt=tuple(range(5, 205)), robot_id="amr-7"))
        reply = peer.recv()
        assert isinstance(reply, Error) and reply.code is ErrorCode.INVALID_REQUEST
        assert "203 tokens" in reply.message and "long" not in lane.started
        peer.sock.close()


def test_prompt_tokens_spend_the_minute_s_quota():
    with running(config(robot_quota=QuotaConfig(tokens_per_min=100))) as lane:
        peer = Peer(lane.front.endpoints[0])
        peer.send(gen("p1", max_tokens=3, prompt=tuple(range(5, 65)), robot_id="amr-7"))  # 63 tokens
        assert isinstance(peer.until_end()[1], Result)
        peer.send(gen("p2", max_tokens=3, prompt=tuple(range(5, 65)), robot_id="amr-7"))  # 37 left: wait
        reply = peer.recv()
        assert isinstance(reply, Error) and reply.code is ErrorCode.REJECTED and reply.retry_after_ms > 0
        peer.send(gen("p3", max_tokens=3, prompt=tuple(range(5, 65)), robot_id="amr-8"))  # its own quota
        assert isinstance(peer.until_end()[1], Result)
        peer.sock.close()


def test_one_robot_s_flood_is_capped_at_its_share_and_the_next_robot_gets_in():
    with running(config(robot_max_in_flight=2, shutdown_grace_s=0)) as lane:  # the two left running: cancelled
        peer = Peer(lane.front.endpoints[0])
        for i in range(2):
            peer.send(gen(f"a{i}", max_tokens=1_000, robot_id="amr-7"))  # run until cancelled
        while len(lane.started) < 2:
            peer.send(Stats())
            peer.recv()
        peer.send(gen("a2", max_tokens=1_000, robot_id="amr-7"))
        reply = peer.recv()
        assert isinstance(reply, Error) and reply.code is ErrorCode.REJECTED and "'amr-7'" in reply.message
        assert "2 requests" in reply.message
        peer.send(gen("b0", robot_id="amr-8"))
        assert isinstance(peer.until_end()[1], Result)
        lane.front.check_integrity()  # amr-7's two running requests are its two in flight
        peer.sock.close()


def test_a_robot_s_share_is_given_back_as_its_requests_end():
    with running(config(robot_max_in_flight=1)) as lane:
        peer = Peer(lane.front.endpoints[0])
        for i in range(3):  # one at a time: each ends before the next is sent
            peer.send(gen(f"s{i}", robot_id="amr-7"))
            assert isinstance(peer.until_end()[1], Result)
        peer.send(gen("bad", prompt=(0,), robot_id="amr-7"))  # fails preparing: its share comes back too
        assert peer.recv().code is ErrorCode.INVALID_REQUEST
        peer.send(gen("s3", robot_id="amr-7"))
        assert isinstance(peer.until_end()[1], Result)
        assert len(lane.front.in_flight) == 0
        lane.front.check_integrity()
        peer.sock.close()


def test_a_prompt_ids_frame_longer_than_the_daemon_s_bound_is_refused_as_it_is_decoded():
    """Finding 3: 131,072 prompt_ids cost the socket thread ~40 ms each to decode and check; a
    daemon bounds them by its context, before one Python int is made per id."""
    with running(config(max_prompt_ids=64)) as lane:
        peer = Peer(lane.front.endpoints[0])
        peer.send(gen("big", prompt=tuple(range(5, 5 + 4096))))
        reply = peer.recv()
        assert isinstance(reply, Error) and reply.code is ErrorCode.TOO_LARGE and "64" in reply.message
        peer.send(gen("resumed", prompt=(5,), resume_token_ids=tuple(range(5, 5 + 4096))))
        assert peer.recv().code is ErrorCode.TOO_LARGE
        assert lane.started == []
        peer.sock.close()
