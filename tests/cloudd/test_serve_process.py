"""`cloudd serve` as a real process with the default model, on loopback: the ZeroMQ protocol
(generate, stream, cancel, retry, resume, deadlines), the OpenAI API through the official
`openai` client, /health, /metrics, and a graceful shutdown."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from collections.abc import Iterator

import pytest
import zmq

from shared.daemon_process import DaemonProcess
from shared.protocol.codec import decode, encode
from shared.protocol.messages import ChatMessage, Chunk, ErrorCode, Generate, Priority, Result, Sampling
from shared.transport.client import FleetClient, RequestFailed
from tests.robot_grants import ROBOT_GRANTS_TOML as ROBOT_GRANTS

TASK = (ChatMessage("system", "You plan tasks for a warehouse robot."),
        ChatMessage("user", "Bring crate 17 from aisle 4 to the packing station."))


def serve(tmp_path, *extra: str, config: str = "") -> DaemonProcess:
    cfg = tmp_path / "cloudd.toml"
    # NOTE: float32, not "auto": in bfloat16 a prompt's last logits round differently after a
    # prefix-cache hit than in a cold prefill, so two greedy runs of one task may part at a near-tie.
    cfg.write_text('[engine]\nnum_blocks = 2048\ndtype = "float32"\n' + config)
    return DaemonProcess("cloudd", ["serve", "--config", str(cfg), "--zmq-port", "0", "--http-port", "0", *extra],
                         ready="cloudd ready:")


# its robots send safety, which [serve] grants only where named (issue 48: priority is a permission)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    d = serve(tmp_path_factory.mktemp("cloudd"), config=ROBOT_GRANTS)
    yield d
    assert d.terminate() == 0, d.log()


@pytest.fixture
def client(daemon) -> Iterator[FleetClient]:
    with FleetClient(daemon.fields["zmq"]) as c:
        yield c


def plan(rid: str, max_tokens: int = 24, **kw) -> Generate:
    return Generate(rid, messages=TASK, sampling=Sampling(max_tokens=max_tokens), **kw)


def test_the_ready_line_says_how_the_engine_started(daemon):
    assert daemon.fields["compile"] == "off"  # the test config leaves [engine] compile off
    assert float(daemon.fields["warm_up"].removesuffix("s")) > 0  # a full step ran before the first request


def test_sighup_reloads_keys_and_the_daemon_keeps_serving(daemon, client):
    """SIGHUP is the key-rotation signal: it must not end the daemon (its default action)."""
    daemon.proc.send_signal(signal.SIGHUP)
    assert client.health(timeout_s=30) == "ok"
    assert daemon.proc.poll() is None


def test_generate_returns_the_model_s_greedy_text(client):
    first = client.generate(plan("gen-1"), timeout_s=120)
    again = client.generate(plan("gen-2"), timeout_s=120)
    assert first.text and first.text == again.text  # greedy: the same task, the same text
    assert first.finish_reason in ("stop", "length") and first.source.value == "cloud"
    assert again.usage.cached_tokens > 0  # the second one reused the first one's prompt


def test_stream_chunks_add_up_to_the_result(client):
    events = list(client.stream(plan("stream-1", robot_id="amr-7"), timeout_s=120))
    chunks, result = events[:-1], events[-1]
    assert isinstance(result, Result) and chunks
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert "".join(c.text for c in chunks) == result.text


def test_cancel_mid_stream_frees_the_request_s_kv(client):
    events = client.stream(plan("cancel-1", max_tokens=400), timeout_s=120)
    assert isinstance(next(events), Chunk)
    result = client.cancel("cancel-1")
    assert result.finish_reason == "abort" and result.usage.completion_tokens < 400
    stats = client.stats()
    assert all(r["request_id"] != "cancel-1" for r in stats["running"])
    assert stats["engine"]["kv_blocks_in_requests"] == 0


def test_a_retry_with_the_same_id_runs_once(daemon, client):
    before = client.stats()["totals"]["requests"]
    with FleetClient(daemon.fields["zmq"]) as other:
        a = client.start(plan("retry-1"))
        b = other.start(plan("retry-1"))
        assert a.result(120) == b.result(120)
    assert client.stats()["totals"]["requests"] == before + 1


def test_a_dropped_stream_resumes_from_its_last_chunk(daemon):
    ctx = zmq.Context.instance()
    first = ctx.socket(zmq.DEALER)
    first.connect(daemon.fields["zmq"])
    first.send(encode(plan("resume-1", max_tokens=30, stream=True)))
    got = [decode(first.recv()) for _ in range(3)]
    first.close(linger=0)
    second = ctx.socket(zmq.DEALER)
    second.connect(daemon.fields["zmq"])
    second.send(encode(plan("resume-1", max_tokens=30, stream=True, resume_from=3)))
    rest = []
    while not isinstance(msg := decode(second.recv()), Result):
        rest.append(msg)
    second.close(linger=0)
    assert [c.seq for c in got + rest] == list(range(len(got) + len(rest)))
    assert "".join(c.text for c in got + rest) == msg.text


def test_deadlines_reject_what_cannot_start_in_time_and_stop_what_overruns(client):
    client.generate(plan("warm-up", max_tokens=4), timeout_s=120)  # the server has measured its rate
    with pytest.raises(RequestFailed) as info:
        client.generate(plan("too-soon", deadline_ms=1))
    assert info.value.code is ErrorCode.DEADLINE
    stopped = client.generate(Generate("overrun", messages=TASK, deadline_ms=700,
                                       sampling=Sampling(max_tokens=500, ignore_eos=True)), timeout_s=120)
    assert stopped.finish_reason == "deadline" and 0 < stopped.usage.completion_tokens < 500


def test_the_openai_client_gets_completions_and_streams(daemon):
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url=daemon.fields["http"] + "/v1", api_key="unused", max_retries=0)
    model = api.models.list().data[0].id
    chat = api.chat.completions.create(
        model=model, messages=[m.as_dict() for m in TASK], max_tokens=16, temperature=0,
        extra_body={"priority": "interactive", "robot_id": "amr-3"},
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 16
    stream = api.chat.completions.create(
        model=model, messages=[m.as_dict() for m in TASK], max_tokens=16, temperature=0,
        stream=True,
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == chat.choices[0].message.content
    text = api.completions.create(model=model, prompt="A robot arm picks", max_tokens=8, temperature=0)
    assert text.choices[0].text
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=model, messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                    extra_body={"priority": "urgent-please"})


def test_structured_output_over_both_surfaces(daemon, client):
    schema = {"type": "object", "properties": {"skill": {"enum": ["goto", "dock"]}, "speed": {"type": "integer"}},
              "required": ["skill", "speed"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "move", "schema": schema}}
    result = client.generate(Generate("structured-1", messages=TASK, sampling=Sampling(max_tokens=40),
                                      response_format=rf), timeout_s=120)
    plan = json.loads(result.text)
    assert plan["skill"] in ("goto", "dock") and isinstance(plan["speed"], int)
    with pytest.raises(RequestFailed) as info:
        client.generate(Generate("structured-bad", messages=TASK, response_format={"type": "regex", "regex": "(x"}))
    assert info.value.code is ErrorCode.INVALID_REQUEST and "regex" in str(info.value)
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url=daemon.fields["http"] + "/v1", api_key="unused", max_retries=0)
    chat = api.chat.completions.create(model="any", messages=[m.as_dict() for m in TASK],
                                       max_tokens=40, temperature=0, response_format=rf)
    assert json.loads(chat.choices[0].message.content) == plan  # greedy: the same plan
    assert client.stats()["grammar"]["cache_hits"] >= 1


def test_health_and_prometheus_metrics(daemon, client):
    client.generate(plan("metrics-1", max_tokens=4, priority=Priority.SAFETY, robot_id="amr-9"), timeout_s=120)
    with urllib.request.urlopen(daemon.fields["http"] + "/health", timeout=10) as r:
        assert json.load(r) == {"status": "ok"}
    with urllib.request.urlopen(daemon.fields["http"] + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    for name in ("fleetserve_ttft_seconds_bucket", "fleetserve_tpot_seconds_bucket", "fleetserve_e2e_seconds_bucket",
                 "fleetserve_queue_seconds_bucket", "fleetserve_running_requests", "fleetserve_waiting_requests",
                 "fleetserve_kv_blocks_used", "fleetserve_prefix_cache_hit_tokens_total",
                 "fleetserve_preemptions_total", "fleetserve_deadline_misses_total", "fleetserve_rejections_total"):
        assert name in metrics, name
    assert 'priority="safety",robot="amr-9"' in metrics


def test_shutdown_rejects_new_work_cancels_running_requests_with_a_reply_and_exits_cleanly(tmp_path):
    d = serve(tmp_path, config="[serve]\nshutdown_grace_s = 1.0\n")
    with FleetClient(d.fields["zmq"]) as c:
        long = c.start(Generate("long", messages=TASK, sampling=Sampling(max_tokens=2000, ignore_eos=True)))
        time.sleep(2.0)
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(RequestFailed) as info:
            c.generate(plan("late"), timeout_s=30)
        assert info.value.code is ErrorCode.REJECTED
        result = long.result(60)
        assert result.finish_reason == "abort" and result.usage.completion_tokens > 0
    assert d.terminate() == 0
    assert d.lines[-1] == "cloudd: stopped"


def test_error_replies_keep_their_codes_over_http(daemon):
    request = urllib.request.Request(daemon.fields["http"] + "/v1/chat/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 400 and "not JSON" in json.load(info.value)["error"]["message"]
