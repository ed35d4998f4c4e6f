"""The cluster front charges a chat request's prompt tokens to its robot's token quota, as
``cloudd serve`` does (issue 48 finding 5 through the cluster): the front counts them with
``count_prompt``; the replicas (``test_fair_admission``'s stand-in) never see a request over quota."""

from __future__ import annotations

import threading

import pytest

from cloudd.cluster.front import ClusterFront
from shared.protocol.messages import ChatMessage, ErrorCode, Generate, Sampling
from shared.transport.client import FleetClient, RequestFailed
from shared.transport.quota import QuotaConfig
from shared.transport.request_front import FrontConfig
from tests.cluster.test_fair_admission import WAIT_S, HeldReplicas

LONG_CHAT = (ChatMessage("user", "bring tote 12 to the dock " * 100),)


@pytest.mark.parametrize("counted", [True, False])
def test_a_chat_prompt_is_charged_its_tokens_at_the_cluster_front(counted):
    replicas = HeldReplicas()
    config = FrontConfig("cluster test", ("tcp://127.0.0.1:0",), shutdown_grace_s=0.0,
                         robot_quota=QuotaConfig(tokens_per_min=200))
    front = ClusterFront(replicas, "test-quota", config, resume_retries=0, model_name="m", replicas=1,
                         count_prompt=(lambda msg: len(msg.messages[0].content.split())) if counted else None)
    loop = threading.Thread(target=front.serve_forever, daemon=True)
    loop.start()
    try:
        with FleetClient(front.endpoint) as client:
            call = client.start(Generate("long-1", messages=LONG_CHAT, robot_id="amr-1", sampling=Sampling(max_tokens=8)))
            if counted:  # 600 prompt tokens + 8: more than the robot may use in a minute
                with pytest.raises(RequestFailed) as over:
                    call.result(WAIT_S)
                assert over.value.error.code is ErrorCode.INVALID_REQUEST and "quota" in over.value.error.message
                assert replicas.dispatched == []
            else:  # without a tokenizer only its max_tokens count
                replicas.release("long-1")
                assert call.result(WAIT_S).finish_reason == "length"
    finally:
        front.stop()
        loop.join(WAIT_S)
