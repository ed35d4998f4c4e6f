"""cloudd's ``health`` names the request whose own work held a step past ``stall_after_s``
(issue 48: one request's grammar made every robot wait 3-5 s while ``/health`` said ``ok``),
for ``DEGRADED_FOR_S`` after that step. Timed by fake timers and a fake engine clock."""

from __future__ import annotations

import itertools


from cloudd.server import DEGRADED_FOR_S, CloudServer, ServeConfig
from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.request_budget import WorkMeter
from shared.engine.sampling_params import SamplingParams
from tests.engine.tiny import tiny_model


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_health_is_degraded_naming_the_request_whose_work_made_a_step_slow(tokenizer, monkeypatch):
    monkeypatch.setattr(WorkMeter, "timer", staticmethod(lambda: 0.0))
    clock = FakeClock()
    engine = Engine(tiny_model(vocab_size=tokenizer.vocab_size), tokenizer,
                    EngineConfig(block_size=4, num_blocks=64, request_step_budget_s=1000.0), clock=clock)
    server = CloudServer(engine, ServeConfig(zmq_port=0, stall_after_s=5.0), "tiny")
    try:
        rid = engine.submit("plan a route", SamplingParams(max_tokens=8), "amr-001/x", buffered=False,
                            response_format={"type": "regex", "regex": "[a-z]{30}"})
        while engine.get_request(rid).num_output_tokens == 0:
            server.work()
        assert server.front.health() == "ok"  # its work so far cost nothing

        engine.get_request(rid).grammar.work.timer = itertools.count(0.0, 6.0).__next__  # 6 s a call
        server.work()
        health = server.front.health()
        assert health.startswith("degraded: request amr-001/x took ")
        assert health.endswith(" s of grammar and detokenizer work in one step")

        clock.now += DEGRADED_FOR_S + 1
        assert server.front.health() == "ok"
    finally:
        server.socket.close(linger=0)
        engine.close()
