"""edged's local endpoints admit only the robot's own user (issue 48, finding 8): by default one
``ipc://`` socket (0600) in a directory only its user may enter (0700); ``tcp://`` only with
CURVE keys, which then turn away a client with no key or an unknown one.

The server runs in this process over a stand-in local worker: what is tested is the socket in
front of it (binding, permissions, keys, health), not the model behind it.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import zmq

from edged.server import EdgeServeConfig, EdgeServer
from robot_sdk import PlanClient
from shared.protocol.messages import ChatMessage, ErrorCode, Generate, Sampling
from shared.transport.client import ClientConfig, FleetClient, RequestFailed
from shared.transport.curve import ClientCurve, create_keys
from shared.transport.local_socket import EDGED_ENDPOINT
from tests.serving_thread import serving_thread

NOBODY = 65534


class IdleWorker:
    """The local worker's face that the socket needs: nothing runs behind it."""

    generator = SimpleNamespace(tokenizer=None)
    depth = 0

    def stop(self) -> None:
        pass


@contextmanager
def serving(config: EdgeServeConfig) -> Iterator[EdgeServer]:
    """An edged front on ``config``'s endpoints, serving until the block ends."""
    context = zmq.Context()
    server = EdgeServer(IdleWorker(), compiler=None, policy=None, cloud=None, config=config, model=None,
                        context=context)
    try:
        with serving_thread(server):
            yield server
    finally:
        context.term()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def private_endpoint(root: Path) -> str:
    return f"ipc://{root}/run/edged.sock"


# --- the default ----------------------------------------------------------------------------------


def test_the_default_endpoint_is_one_ipc_socket_under_the_users_home():
    assert EdgeServeConfig().endpoints == (EDGED_ENDPOINT,)
    assert EDGED_ENDPOINT == "ipc://~/.cache/fleetserve/run/edged.sock"


def test_the_default_socket_is_private_and_the_sdk_reaches_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    with serving(EdgeServeConfig(pinned_dir=str(tmp_path / "pinned"))) as server:
        sock = tmp_path / ".cache/fleetserve/run/edged.sock"
        assert server.endpoints == [f"ipc://{sock}"]
        assert stat.S_ISSOCK(sock.stat().st_mode)
        assert mode(sock.parent) == 0o700 and mode(sock) == 0o600
        with PlanClient(EDGED_ENDPOINT, robot_id="amr-030", timeout_s=30, retries=0) as robot:
            assert robot.health() == "ok"


# --- ipc:// permissions ---------------------------------------------------------------------------


def test_an_existing_socket_directory_open_to_others_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(ValueError, match=f"{shared}.*0700"):
        EdgeServer(IdleWorker(), None, None, None, EdgeServeConfig(endpoints=(f"ipc://{shared}/edged.sock",)), None)
    assert not (shared / "edged.sock").exists()


def test_the_old_default_under_tmp_is_refused():
    with pytest.raises(ValueError, match="/tmp"):
        EdgeServer(IdleWorker(), None, None, None,
                   EdgeServeConfig(endpoints=("ipc:///tmp/fleetserve-edged.sock",)), None)


@pytest.mark.skipif(os.geteuid() != 0, reason="connecting as another user needs root to switch users")
def test_another_local_user_cannot_connect():
    """``nobody`` may enter the parent directory and connect to an open socket there (the
    control), but not to edged's."""
    base = Path(tempfile.mkdtemp(prefix="edged-perm-"))
    try:
        base.chmod(0o755)
        control_path = base / "open.sock"
        control = socket.socket(socket.AF_UNIX)
        control.bind(str(control_path))
        control.listen()
        control_path.chmod(0o777)
        with serving(EdgeServeConfig(endpoints=(private_endpoint(base),))):
            probe = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\n"
                     "try:\n    s.connect(sys.argv[1]); print('connected')\n"
                     "except PermissionError:\n    print('denied')\n")

            def connect_as_nobody(path: Path) -> str:
                return subprocess.run(["/usr/bin/python3", "-I", "-S", "-c", probe, str(path)], user=NOBODY,
                                      capture_output=True, text=True, timeout=60, check=True).stdout.strip()

            assert connect_as_nobody(control_path) == "connected"
            assert connect_as_nobody(base / "run/edged.sock") == "denied"
        control.close()
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=True)


# --- tcp:// and CURVE -----------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5556", "ipc://@fleetserve-edged"])
def test_an_endpoint_file_permissions_cannot_guard_needs_curve(endpoint):
    with pytest.raises(ValueError, match="curve_secret_key"):
        EdgeServeConfig(endpoints=(endpoint,))


@pytest.mark.parametrize("keys, words", [
    ({"curve_secret_key": "s.key_secret"}, "curve_authorized_dir"),
    ({"curve_authorized_dir": "robots"}, "curve_secret_key"),
    ({"curve_operator_dir": "operators"}, "curve_secret_key"),
])
def test_curve_keys_come_together(keys, words):
    with pytest.raises(ValueError, match=words):
        EdgeServeConfig(endpoints=("ipc:///run/x/edged.sock",), **keys)


def request(rid: str) -> Generate:
    return Generate(rid, messages=(ChatMessage("user", "go to the dock"),), sampling=Sampling(max_tokens=8))


def test_with_curve_only_authorized_keys_reach_the_tcp_endpoint(tmp_path):
    _, server_secret = create_keys(tmp_path / "server", "edged")
    server_public = tmp_path / "server/edged.key"
    _, node_secret = create_keys(tmp_path / "processes", "ros-node")
    _, rogue_secret = create_keys(tmp_path / "rogue", "rogue")
    config = EdgeServeConfig(endpoints=(private_endpoint(tmp_path), "tcp://127.0.0.1:0"),
                             curve_secret_key=str(server_secret), curve_authorized_dir=str(tmp_path / "processes"))
    with serving(config) as server:
        tcp = next(ep for ep in server.endpoints if ep.startswith("tcp://"))
        node = ClientCurve.from_files(server_public, node_secret)
        with FleetClient(tcp, ClientConfig(timeout_s=30, retries=0, curve=node)) as client:
            assert client.health() == "ok"
        rogue = ClientCurve.from_files(server_public, rogue_secret)
        with FleetClient(tcp, ClientConfig(timeout_s=30, retries=0, curve=rogue)) as client:
            with pytest.raises(RequestFailed) as refused:
                client.generate(request("rogue/1"), timeout_s=60)
        assert refused.value.code is ErrorCode.UNAVAILABLE and "refused" in str(refused.value)
        with FleetClient(tcp, ClientConfig(timeout_s=2, retries=0)) as keyless:
            with pytest.raises(RequestFailed) as unanswered:
                keyless.generate(request("anyone/1"), timeout_s=60)
        assert unanswered.value.code is ErrorCode.UNAVAILABLE
        assert server.front.counters.requests == 0  # neither reached the daemon
