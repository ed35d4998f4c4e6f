"""Real `edged serve` and `cloudd serve` processes on loopback, linked with CURVE: a local
answer, escalation by each rule, the cloud killed mid-request (local fallback inside the
deadline), the cloud back (escalation resumes), a restart that reads the pinned KV from disk,
and a robot key the cloud does not know."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from robot_sdk import PlanClient, PlanDone, PlanStepEvent, PlanText
from shared.daemon_process import DaemonProcess
from shared.engine.grammar.response_format import fleet_plan_format
from shared.protocol.codec import decode, encode
from shared.protocol.messages import (Cancel, ChatMessage, Chunk, Error, ErrorCode, Escalation, Generate, Health, Message,
                                      Result, Sampling, Source)
from shared.transport.client import ClientConfig, FleetClient, RequestFailed
from shared.transport.curve import ClientCurve, create_keys
from shared.transport.loopback import free_port

SYSTEM = (Path(__file__).resolve().parents[2] / "configs/prompts/amr.txt").read_text()
MAX_LEN = 640


def task(text: str) -> tuple[ChatMessage, ...]:
    return ChatMessage("system", SYSTEM), ChatMessage("user", f"Scene: Robot amr-030 at dock 2.\nTask: {text}")


def request(rid: str, text: str = "go to waypoint 17.", max_tokens: int = 24, **kw) -> Generate:
    return Generate(rid, messages=task(text), sampling=Sampling(max_tokens=max_tokens), **kw)



class Fleet:
    """Keys, a cloudd on a fixed port (so it can be killed and brought back) and edged configs."""

    def __init__(self, root: Path):
        self.root = root
        self.server_public, self.server_secret = create_keys(root / "server", "cloudd")
        self.robot_public, self.robot_secret = create_keys(root / "robots", "amr-030")
        _, self.rogue_secret = create_keys(root / "rogue", "rogue")
        self.port = free_port()
        self.cloud_endpoint = f"tcp://127.0.0.1:{self.port}"
        self.cloudd: DaemonProcess | None = None

    def start_cloud(self) -> DaemonProcess:
        cfg = self.root / "cloudd.toml"
        cfg.write_text(f'[engine]\nnum_blocks = 2048\n[serve]\ncurve_secret_key = "{self.server_secret}"\n'
                       f'curve_authorized_dir = "{self.root / "robots"}"\n')
        self.cloudd = DaemonProcess("cloudd", ["serve", "--config", str(cfg), "--zmq-port", str(self.port),
                                               "--http-port", "0"], ready="cloudd ready:")
        return self.cloudd

    def start_edge(self, name: str, min_mean_logprob: float = -9.0) -> DaemonProcess:
        cfg = self.root / f"{name}.toml"
        (self.root / "amr.txt").write_text(SYSTEM)
        cfg.write_text(f"""
[backend]
kind = "torch"
quant = "none"
max_len = {MAX_LEN}
threads = 1
[serve]
robot_id = "amr-030"
endpoints = ["ipc://{self.root / name}.sock"]
pinned_dir = "{self.root / 'pinned'}"
[escalation]
cloud_endpoint = "{self.cloud_endpoint}"
server_public_key = "{self.server_public}"
robot_secret_key = "{self.robot_secret}"
escalate_tags = ["multi-floor"]
min_mean_logprob = {min_mean_logprob}
link_timeout_s = 1.0
heartbeat_s = 0.25
breaker_failures = 1
breaker_cooldown_s = 1.0
[[pinned]]
name = "amr"
file = "amr.txt"
""")
        return DaemonProcess("edged", ["serve", "--config", str(cfg)], ready="edged ready:")


def endpoint(edge: DaemonProcess) -> str:
    """edged's one endpoint: an ipc:// socket in the test's own directory."""
    return edge.fields["endpoints"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    f.start_cloud()
    yield f
    if f.cloudd is not None:
        f.cloudd.kill()


@pytest.fixture(scope="module")
def edge(fleet) -> Iterator[DaemonProcess]:
    d = fleet.start_edge("edged")
    yield d
    assert d.terminate() == 0, d.log()


@pytest.fixture
def client(edge) -> Iterator[FleetClient]:
    with FleetClient(endpoint(edge)) as c:
        yield c


def test_a_plain_request_is_answered_on_the_robot_from_its_pinned_prompt(client):
    result = client.generate(request("local-1"), timeout_s=120)
    assert result.source.value == "edge" and not result.degraded and result.escalation_reason is None
    assert result.usage.cached_tokens >= 300  # the pinned system prompt was not prefilled again
    assert result.text and result.timings["ttft_s"] <= result.timings["e2e_s"]


def test_the_ready_lines_and_edgeds_stats_name_the_model(fleet, edge, client):
    named = "SmolLM2-135M-Instruct.Q4_1 (llama, 135M params)"
    assert f"model={named} " in next(line for line in edge.lines if line.startswith("edged ready:"))
    assert f"model={named} " in next(line for line in fleet.cloudd.lines if line.startswith("cloudd ready:"))
    stats = client.stats(timeout_s=10)
    assert (stats["model"], stats["model_arch"], stats["model_params"]) == \
        ("SmolLM2-135M-Instruct.Q4_1", "llama", 134_515_008)


@pytest.mark.parametrize("kw, reason", [
    ({"escalation": Escalation.CLOUD}, "requested"),
    ({"tags": ("multi-floor",)}, "tags"),
    ({"text": "go to waypoint 17. " * 120}, "context"),
    ({"response_format": fleet_plan_format(), "max_tokens": 6}, "invalid_plan"),
])
def test_each_rule_escalates_and_the_cloud_answers(client, kw, reason):
    result = client.generate(request(f"esc-{reason}", **kw), timeout_s=180)
    assert (result.source.value, result.escalation_reason, result.degraded) == ("cloud", reason, False)
    assert "cloud_s" in result.timings


def test_a_local_queue_that_cannot_meet_the_deadline_escalates(client):
    result = client.generate(request("esc-queue", max_tokens=200, deadline_ms=1500), timeout_s=60)
    assert result.escalation_reason == "local_queue"


def test_a_stream_answered_locally_arrives_in_chunks(client):
    events = list(client.stream(request("stream-1", max_tokens=12), timeout_s=120))
    assert isinstance(events[-1], Result) and len(events) > 2
    assert "".join(e.text for e in events[:-1]) == events[-1].text
    assert all(e.source is Source.EDGE for e in events)


def test_a_plan_streamed_on_the_robot_says_so_from_its_first_step(edge):
    with PlanClient(endpoint(edge), robot_id="amr-031", timeout_s=120) as robot:
        events = list(robot.stream("go to waypoint 17.", skills=[goto], escalation="local", max_steps=1,
                                   max_tokens=128))
    steps = [e for e in events if isinstance(e, PlanStepEvent)]
    assert steps and {e.source for e in events if isinstance(e, PlanText | PlanStepEvent)} == {"edge"}
    assert isinstance(events[-1], PlanDone) and events[-1].plan.source == "edge"


def test_bad_requests_get_clear_errors_and_the_daemon_keeps_serving(client):
    with pytest.raises(RequestFailed) as e:
        client.generate(request("bad-1", response_format={"type": "regex"}), timeout_s=30)
    assert e.value.code is ErrorCode.INVALID_REQUEST
    assert client.health(timeout_s=10) == "ok"


def test_a_prompt_past_max_prompt_chars_is_refused_before_it_is_tokenized(client):
    huge = Generate("huge-1", messages=(ChatMessage("user", "word " * 60_000),), sampling=Sampling(max_tokens=4))
    with pytest.raises(RequestFailed) as e:
        client.generate(huge, timeout_s=30)
    assert e.value.code is ErrorCode.INVALID_REQUEST and "max_prompt_chars 262144" in e.value.error.message
    assert client.health(timeout_s=10) == "ok"


def _dealer(edge: DaemonProcess) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint(edge))
    return sock


def _final(sock: zmq.Socket) -> Message:
    while True:
        assert sock.poll(60_000), "no reply"
        reply = decode(sock.recv())
        if not isinstance(reply, Chunk):
            return reply


def test_health_is_answered_while_a_long_prompt_is_tokenized_and_a_retry_then_joins_it(edge):
    # 200,000 snowmen: 600,000 tokens, a few hundred ms of tokenizing, then refused for the robot's
    # context and the cloud's alike; meanwhile health, and the same request again, arrive
    slow = Generate("slow-tok", messages=(ChatMessage("user", "\u2603" * 200_000),), sampling=Sampling(max_tokens=4),
                    escalation=Escalation.LOCAL)
    first, second = _dealer(edge), _dealer(edge)
    try:
        first.send(encode(slow))
        first.send(encode(Health()))
        second.send(encode(slow))  # a retry from another connection while it is being prepared
        assert decode(first.recv()) == Health("ok")  # before the request's answer: not behind it
        a, b = _final(first), _final(second)
        assert isinstance(a, Error) and a.code is ErrorCode.INVALID_REQUEST and a == b
    finally:
        first.close(), second.close()


def test_a_cancel_while_a_request_is_prepared_ends_it_before_it_runs(edge):
    slow = Generate("cancel-early", messages=(ChatMessage("user", "go. " * 60_000),), sampling=Sampling(max_tokens=4))
    sock = _dealer(edge)
    try:
        sock.send(encode(slow))
        sock.send(encode(Cancel("cancel-early")))
        first, second = _final(sock), _final(sock)
        assert first == second and isinstance(first, Result) and first.finish_reason == "abort"
        assert first.usage.completion_tokens == 0
    finally:
        sock.close()


@pytest.mark.parametrize("idle_s", [0.0, 1.5], ids=["at-once", "after-the-handshake-failed"])
def test_a_robot_key_the_cloud_does_not_know_is_refused(fleet, idle_s):
    curve = ClientCurve.from_files(fleet.server_public, fleet.rogue_secret)
    with FleetClient(fleet.cloud_endpoint, ClientConfig(timeout_s=5, retries=0, curve=curve)) as rogue:
        time.sleep(idle_s)  # the refusal may come before any request is in flight
        with pytest.raises(RequestFailed) as e:
            rogue.generate(request("rogue-1"), timeout_s=30)
    assert e.value.code is ErrorCode.UNAVAILABLE and "refused" in str(e.value)


def goto(waypoint: str) -> None:
    """drive to a named waypoint"""


def test_the_cloud_killed_mid_request_falls_back_locally_and_comes_back(fleet, edge, client):
    call = client.start(request("kill-1", max_tokens=256, escalation=Escalation.CLOUD, deadline_ms=60_000))
    time.sleep(1.5)  # the escalation is running in the cloud
    start = time.monotonic()
    fleet.cloudd.kill()
    result = call.result(timeout_s=120)
    assert result.source.value == "edge" and result.degraded and result.escalation_reason == "requested"
    assert "cloud" in result.detail
    assert time.monotonic() - start < 60  # inside the deadline
    with PlanClient(endpoint(edge), robot_id="amr-030", timeout_s=120) as robot:  # what robots see
        down = robot.plan("go to waypoint 17.", skills=[goto], escalation="cloud", max_steps=1, max_tokens=128)
    assert (down.source, down.degraded, down.escalation_reason) == ("edge", True, "requested")
    assert [step.skill for step in down.steps] == ["goto"]
    fleet.start_cloud()
    ends = time.monotonic() + 90
    while True:  # the breaker lets a trial through after its cooldown; the link reconnects
        back = client.generate(request(f"back-{time.monotonic()}", escalation=Escalation.CLOUD, max_tokens=8),
                               timeout_s=120)
        if back.source.value == "cloud" or time.monotonic() > ends:
            break
        time.sleep(1.0)
    assert back.source.value == "cloud" and not back.degraded
    stats = client.stats(timeout_s=10)
    assert stats["fallbacks"] >= 2 and stats["cloud"]["breaker"] == "closed"
    spec = stats["speculation"]  # the local plans were decoded with drafts (the plan grammar forces text;
    # how many were sent after the first forwards depends on their timed cost)
    assert spec["enabled"] and 0 <= spec["accepted_drafts"] <= spec["drafted_tokens"] and spec["drafted_tokens"] > 0


def test_a_restart_reads_the_pinned_kv_from_disk_and_gives_the_same_tokens(fleet, client):
    before = client.generate(request("same-1", escalation=Escalation.LOCAL), timeout_s=120)
    again = fleet.start_edge("restarted", min_mean_logprob=0.0)  # every plan is "unsure"
    try:
        with FleetClient(endpoint(again)) as c2:
            stats = c2.stats(timeout_s=10)
            assert stats["pinned"] == [{"name": "amr", "tokens": stats["pinned"][0]["tokens"], "from_disk": True}]
            after = c2.generate(request("same-1", escalation=Escalation.LOCAL), timeout_s=120)
            assert after.token_ids == before.token_ids
            assert after.usage.cached_tokens == stats["pinned"][0]["tokens"]  # no prefill of the pinned prompt
            unsure = c2.generate(request("unsure-1"), timeout_s=180)
            assert unsure.escalation_reason == "low_confidence" and unsure.source.value == "cloud"
    finally:
        assert again.terminate() == 0, again.log()
