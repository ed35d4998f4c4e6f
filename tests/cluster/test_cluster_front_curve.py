"""The cluster front robots reach over the network (issue 50): built from ``[serve]`` like
``cloudd serve``'s, it takes the same CURVE keys. A robot with an authorized key is served (in its
own id namespace), an unknown key is turned away before anything reaches a replica. Without Ray:
the replicas are ``test_fair_admission``'s stand-in handle."""

from __future__ import annotations

import threading

import pytest

from cloudd.cluster.front import ClusterFront
from cloudd.server import ServeConfig
from shared.protocol.messages import ErrorCode, Generate, Sampling
from shared.transport.client import ClientConfig, FleetClient, RequestFailed
from shared.transport.curve import ClientCurve, create_keys
from tests.cluster.test_fair_admission import WAIT_S, HeldReplicas


def ask(request_id: str) -> Generate:
    return Generate(request_id, prompt_ids=(1, 2, 3), robot_id="someone-else", sampling=Sampling(max_tokens=1))


def test_the_cluster_front_with_curve_serves_an_authorized_robot_and_refuses_an_unknown_key(tmp_path):
    _, server_secret = create_keys(tmp_path / "server", "cluster")
    _, robot_secret = create_keys(tmp_path / "robots", "amr-001")
    _, rogue_secret = create_keys(tmp_path / "rogue", "rogue")
    serve = ServeConfig(zmq_port=0, curve_secret_key=str(server_secret), curve_authorized_dir=str(tmp_path / "robots"))
    replicas = HeldReplicas()
    front = ClusterFront(replicas, "test-curve", serve.front(), resume_retries=0, model_name="m", replicas=1)
    loop = threading.Thread(target=front.serve_forever, daemon=True)
    loop.start()
    server_public = tmp_path / "server" / "cluster.key"
    try:
        robot = ClientCurve.from_files(server_public, robot_secret)
        with FleetClient(front.endpoint, ClientConfig(timeout_s=WAIT_S, retries=0, curve=robot)) as client:
            served = client.start(ask("amr-001/plan-1"))
            replicas.release("amr-001/plan-1")
            assert served.result(WAIT_S).finish_reason == "length"
            with pytest.raises(RequestFailed) as outside:
                client.generate(ask("amr-002/plan-1"), timeout_s=WAIT_S)  # another robot's namespace
            assert outside.value.error.code is ErrorCode.INVALID_REQUEST
        rogue = ClientCurve.from_files(server_public, rogue_secret)
        with FleetClient(front.endpoint, ClientConfig(timeout_s=WAIT_S, retries=0, curve=rogue)) as client:
            with pytest.raises(RequestFailed) as refused:
                client.generate(ask("rogue/plan-1"), timeout_s=WAIT_S)
        assert refused.value.code is ErrorCode.UNAVAILABLE and "refused" in str(refused.value)
        assert replicas.dispatched == ["amr-001/plan-1"]  # nothing else reached a replica
    finally:
        front.stop()
        loop.join(WAIT_S)
