"""cloudd parses a constrained answer once and sends it as the result's ``plan`` (edged and the
SDK read that, never parsing a cloud answer again); other answers carry none. In-process with
the default model, one-step plans that the grammar mostly forces."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest

from cloudd.server import CloudServer, ServeConfig
from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.model.llama import build_model
from shared.protocol.messages import ChatMessage, Generate, Sampling
from shared.transport.client import FleetClient

SKILLS = [{"name": "undock", "description": "leave the dock", "args": {}},
          {"name": "goto", "description": "drive to a place", "args": {"place": ["dock 2", "aisle 4"]}}]
TASK = (ChatMessage("user", "Leave the dock, then drive to aisle 4. Answer with a JSON plan."),)


@pytest.fixture(scope="module")
def server(default_checkpoint) -> Iterator[CloudServer]:
    model = build_model(default_checkpoint.config, default_checkpoint.weights)
    engine = Engine(model, default_checkpoint.tokenizer, EngineConfig(num_blocks=256))
    server = CloudServer(engine, ServeConfig(zmq_port=0), "default")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.stop()
    thread.join(timeout=10)


def ask(server: CloudServer, rid: str, response_format: dict | None, max_tokens: int):
    with FleetClient(server.endpoint) as client:
        return client.generate(Generate(rid, messages=TASK, sampling=Sampling(max_tokens=max_tokens),
                                        response_format=response_format))


def test_a_plan_request_s_result_carries_its_parsed_plan(server):
    result = ask(server, "plan-1", {"type": "skills", "skills": SKILLS, "max_steps": 1}, 96)
    assert result.finish_reason == "stop", result.text
    assert result.plan == json.loads(result.text) and result.plan["steps"][0]["skill"] in ("undock", "goto")


def test_a_cut_plan_an_unconstrained_answer_and_a_regex_answer_carry_no_plan(server):
    cut = ask(server, "cut-1", {"type": "skills", "skills": SKILLS, "max_steps": 1}, 4)
    assert cut.finish_reason == "length" and cut.plan is None
    assert ask(server, "free-1", None, 4).plan is None
    assert ask(server, "regex-1", {"type": "regex", "regex": "[a-z]{3}"}, 8).plan is None
