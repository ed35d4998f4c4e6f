"""cloudd opens no door it cannot guard: ZeroMQ beyond loopback only with CURVE, the HTTP API
beyond loopback only with API keys; secret keys readable by their owner only."""

from __future__ import annotations

import stat

import pytest

from cloudd.server import ServeConfig
from shared.transport.curve import create_keys
from shared.transport.loopback import is_local_endpoint, is_loopback


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.9", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("192.168.1.7", False), ("::", False), ("cloudd.example", False),
])
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(("endpoint", "local"), [
    ("ipc:///tmp/edged.sock", True), ("tcp://127.0.0.1:5556", True), ("tcp://localhost:5556", True),
    ("tcp://[::1]:5556", True), ("tcp://0.0.0.0:5556", False), ("tcp://10.0.0.2:5556", False),
    ("inproc://x", False), ("udp://127.0.0.1:1", False),
])
def test_local_endpoints(endpoint, local):
    assert is_local_endpoint(endpoint) is local


def test_zeromq_beyond_loopback_needs_curve():
    with pytest.raises(ValueError, match="curve_secret_key"):
        ServeConfig(zmq_host="0.0.0.0")
    ServeConfig(zmq_host="0.0.0.0", curve_secret_key="server.key_secret", curve_authorized_dir="robots")


def test_the_http_api_beyond_loopback_needs_api_keys():
    with pytest.raises(ValueError, match="http_api_keys"):
        ServeConfig(http_host="0.0.0.0", curve_secret_key="server.key_secret", curve_authorized_dir="robots")
    ServeConfig(http_host="0.0.0.0", http_api_keys="api-keys")


def test_secret_keys_are_private_to_their_owner(tmp_path):
    """Found in review: create_keys wrote secret keys world-readable."""
    public, secret = create_keys(tmp_path, "amr-001")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert public.exists()


def test_admitting_all_leaves_admission_to_the_sender_and_keeps_the_rest():
    """A cluster replica (behind the front that checked) and the cluster bench's front."""
    from shared.protocol.messages import Priority

    serve = ServeConfig(zmq_port=0, max_waiting=100, robot_max_in_flight=10)
    front = serve.admitting_all().front()
    assert not front.robot_quota.enabled and not front.frame_quota.enabled and front.robot_max_in_flight == 0
    assert all(front.priority_grants.allows("anyone", p) for p in Priority)
    assert serve.admitting_all().max_waiting == 100 and serve.front().robot_quota.enabled  # the original unchanged
