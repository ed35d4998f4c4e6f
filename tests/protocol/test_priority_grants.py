"""Priority is a permission (issue 48, finding 5): each identity may use the classes granted to
it; a request above its grant is refused ``forbidden``, never downgraded. The identity is a
CURVE robot key's name, else the robot_id a request carries (the in-process HTTP caller's API
key name, or any client where CURVE is off); operator keys may use every class."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from shared.protocol.messages import Error, ErrorCode, Priority, Result
from shared.transport.curve import ClientCurve
from shared.transport.priority_grants import PriorityGrants
from tests.protocol.test_request_front import Peer, config, curve_keys, gen, running

ROBOT_GRANTS = PriorityGrants.from_config(["interactive", "plan", "background"],
                                          {"amr-*": ["safety", "interactive", "plan", "background"]})


def test_an_identity_gets_the_classes_of_the_first_pattern_it_matches_else_the_default():
    grants = PriorityGrants.from_config(["plan"], {"amr-001": ["background"], "amr-*": ["safety", "plan"]})
    assert grants.classes_for("amr-001") == frozenset({Priority.BACKGROUND})
    assert grants.classes_for("amr-002") == frozenset({Priority.SAFETY, Priority.PLAN})
    assert grants.classes_for("tenant-a") == frozenset({Priority.PLAN})
    assert PriorityGrants().classes_for("anyone") == frozenset(Priority)  # a front's default: every class


def test_an_unknown_class_in_a_grant_is_refused_naming_it():
    with pytest.raises(ValueError, match="priority_grants.amr-\\*.*'urgent'"):
        PriorityGrants.from_config(["plan"], {"amr-*": ["urgent"]})
    with pytest.raises(ValueError, match="priorities.*'top'"):
        PriorityGrants.from_config(["top"], {})


def test_without_curve_the_grant_is_the_robot_id_s_and_safety_above_it_is_refused_not_downgraded():
    """The in-process HTTP caller (an operator without a key) sends as its API key's name: that
    name's grant applies, as for any client when CURVE is off."""
    with running(config(priority_grants=ROBOT_GRANTS)) as lane:
        peer = Peer(lane.front.endpoints[0])
        peer.send(gen("t1", robot_id="tenant-a", priority=Priority.SAFETY))
        reply = peer.recv()
        assert isinstance(reply, Error) and reply.code is ErrorCode.FORBIDDEN
        assert "'safety'" in reply.message and "'tenant-a'" in reply.message
        assert "t1" not in lane.started
        peer.send(gen("t2", robot_id="tenant-a", priority=Priority.INTERACTIVE))
        assert isinstance(peer.until_end()[1], Result)
        peer.send(gen("r1", robot_id="amr-7", priority=Priority.SAFETY))
        assert isinstance(peer.until_end()[1], Result)
        peer.sock.close()


def test_with_curve_the_grant_is_the_robot_key_s_whatever_robot_id_it_claims(tmp_path: Path):
    keys = curve_keys(tmp_path, ("amr-001", "cart-001"))
    context = zmq.Context()  # one ZAP authenticator per context
    with running(config(priority_grants=ROBOT_GRANTS, **keys), context) as lane:
        def peer(name: str) -> Peer:
            secret = tmp_path / "secrets" / f"{name}.key_secret"
            curve = ClientCurve.from_files(tmp_path / "server" / "testd.key", secret)
            return Peer(lane.front.endpoints[0], curve, context)

        robot, cart, ops = peer("amr-001"), peer("cart-001"), peer("ops")
        cart.send(gen("cart-001/s", robot_id="amr-001", priority=Priority.SAFETY))  # claims a granted robot
        reply = cart.recv()
        assert isinstance(reply, Error) and reply.code is ErrorCode.FORBIDDEN and "'cart-001'" in reply.message
        robot.send(gen("amr-001/s", priority=Priority.SAFETY))
        assert isinstance(robot.until_end()[1], Result)
        ops.send(gen("ops-s", robot_id="tenant-a", priority=Priority.SAFETY))  # an operator key: every class
        assert isinstance(ops.until_end()[1], Result)
        for p in (robot, cart, ops):
            p.sock.close()
    context.term()
