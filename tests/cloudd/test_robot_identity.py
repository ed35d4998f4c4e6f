"""With CURVE on, a robot is its key: it cannot claim another robot's id, stop or read another
robot's requests, or list them; operators (keys in curve_operator_dir) see and stop everything.
Real CURVE over loopback TCP, cloudd in a thread with the tiny model."""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from cloudd.server import CloudServer, ServeConfig
from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.policy import FleetPolicy
from shared.protocol.messages import Chunk, ErrorCode, Generate, Result, Sampling
from shared.transport.client import ClientConfig, FleetClient, RequestFailed
from shared.transport.curve import ClientCurve, create_keys
from tests.engine.tiny import tiny_model

ROBOTS = ("amr-001", "amr-002")


@contextlib.contextmanager
def running_fleet(root: Path) -> Iterator[tuple[CloudServer, Path]]:
    """(server, key directory): robots' public keys in robots/, the operator's in operators/,
    every secret key in secrets/."""
    for folder, names in (("robots", ROBOTS), ("operators", ("ops",)), ("server", ("cloudd",))):
        (root / folder).mkdir()
        for name in names:
            public, _ = create_keys(root / "secrets", name)
            shutil.copy(public, root / folder)
    engine = Engine(tiny_model(tie_word_embeddings=False), None, EngineConfig(block_size=4, num_blocks=512),
                    policy=FleetPolicy())
    # NOTE: a context of its own: one ZAP authenticator per context, and another fleet may be up
    server = CloudServer(engine, ServeConfig(
        zmq_port=0, curve_secret_key=str(root / "secrets" / "cloudd.key_secret"),
        curve_authorized_dir=str(root / "robots"), curve_operator_dir=str(root / "operators")), "tiny",
        context=zmq.Context())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, root
    finally:
        server.stop()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[tuple[CloudServer, Path]]:
    with running_fleet(tmp_path_factory.mktemp("keys")) as running:
        yield running


def client(fleet, name: str) -> FleetClient:
    server, root = fleet
    curve = ClientCurve.from_files(root / "server" / "cloudd.key", root / "secrets" / f"{name}.key_secret")
    return FleetClient(server.endpoint, ClientConfig(timeout_s=30, retries=0, curve=curve))


def gen(request_id: str, max_tokens: int, robot_id: str = "", stream: bool = False) -> Generate:
    return Generate(request_id, prompt_ids=(5, 9, 2, 77), sampling=Sampling(max_tokens=max_tokens, ignore_eos=True),
                    robot_id=robot_id, stream=stream)


def test_a_robot_cannot_claim_another_robot_s_id(fleet):
    with client(fleet, "amr-002") as robot, client(fleet, "ops") as ops:
        robot.generate(gen("amr-002/claims-001", 2, robot_id="amr-001"), timeout_s=30)
        (row,) = [r for r in ops.stats()["recent"] if r["request_id"] == "amr-002/claims-001"]
        assert row["robot_id"] == "amr-002"


@pytest.mark.parametrize("request_id", ["plan-7", "amr-001/plan-7", "amr-0021/plan-7"])
def test_a_robot_s_request_ids_start_with_its_name_so_none_can_be_taken_by_another(fleet, request_id):
    """Found in review: an id could be squatted before its robot used it."""
    with client(fleet, "amr-002") as robot:
        with pytest.raises(RequestFailed) as refused:
            robot.generate(gen(request_id, 2), timeout_s=30)
    assert refused.value.code is ErrorCode.INVALID_REQUEST and "start with 'amr-002/'" in refused.value.error.message


def test_a_robot_can_neither_stop_nor_list_another_robot_s_request(fleet):
    """Found in review: with CURVE on, robot key amr-002 listed, cancelled and read amr-001's
    request."""
    with client(fleet, "amr-001") as owner, client(fleet, "amr-001") as owner_again, \
            client(fleet, "amr-002") as other, client(fleet, "ops") as ops:
        events = owner.stream(gen("amr-001/long-001", 5000, stream=True), timeout_s=30)
        assert isinstance(next(events), Chunk)  # running
        with pytest.raises(RequestFailed) as refused:
            other.cancel("amr-001/long-001")
        assert refused.value.code is ErrorCode.NOT_FOUND
        seen_by_other = other.stats()
        assert all(r["robot_id"] == "amr-002" for key in ("running", "recent", "robots") for r in seen_by_other[key])
        assert "long-001" not in str(seen_by_other)
        assert any(r["request_id"] == "amr-001/long-001" for r in ops.stats()["running"])
        result = owner_again.cancel("amr-001/long-001")  # its own robot, over another connection (as robot_sdk does)
        assert isinstance(result, Result) and result.finish_reason == "abort"
        with pytest.raises(RequestFailed) as refused:  # and the kept result is not the other robot's either
            other.cancel("amr-001/long-001")
        assert refused.value.code is ErrorCode.NOT_FOUND


def test_an_operator_stops_any_robot_s_request(fleet):
    with client(fleet, "amr-002") as robot, client(fleet, "ops") as ops:
        events = robot.stream(gen("amr-002/long-002", 5000, stream=True), timeout_s=30)
        assert isinstance(next(events), Chunk)
        assert ops.cancel("amr-002/long-002").finish_reason == "abort"


def test_reloaded_keys_admit_a_new_robot_and_refuse_a_removed_one_without_dropping_streams(tmp_path):
    with running_fleet(tmp_path) as fleet:
        server, root = fleet
        with client(fleet, "amr-001") as leaving:
            events = leaving.stream(gen("amr-001/long-003", 5000, stream=True), timeout_s=30)
            assert isinstance(next(events), Chunk)
            (root / "robots" / "amr-001.key").unlink()
            public, _ = create_keys(root / "secrets", "amr-003")
            shutil.copy(public, root / "robots")
            server.reload_keys()
            assert isinstance(next(events), Chunk)  # its stream goes on
            with pytest.raises(RequestFailed) as refused:
                leaving.stats()
            assert refused.value.code is ErrorCode.UNAVAILABLE and "no longer authorized" in refused.value.error.message
        with client(fleet, "amr-003") as joining:
            assert joining.generate(gen("amr-003/new-1", 2), timeout_s=30).finish_reason == "length"
