"""Cluster cases run by ``test_cluster_process.py`` inside a loopback-only network namespace:
2 replicas of the default model behind the fleet router (float32, no compile, half a core each)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from shared.daemon_process import DaemonProcess
from shared.protocol.messages import ChatMessage, Chunk, Generate, Priority, Result, Sampling
from shared.transport.client import FleetClient

# what every replica of these tests runs (the default model, small and eager)
REPLICA_TABLES = """
[engine]
dtype = "float32"
compile = false
num_blocks = 1024
[scheduler]
max_num_seqs = 4
[serve]
precompile = []
"""
CONFIG = """
[cluster]
replicas = 2
num_cpus_per_replica = 0.5
health_check_period_s = 1.0
ray_temp_dir = "{tmp}"
""" + REPLICA_TABLES + """[serve.priority_grants]
s = ["safety", "interactive", "plan", "background"]  # the robot of the safety case
"""
SYSTEM = ChatMessage("system", "You plan tasks for a warehouse robot. Answer with short numbered steps. " * 3)


def task(robot: str, turn: int) -> tuple[ChatMessage, ...]:
    scene = f"You are robot {robot}. Your scene: aisle {robot} has totes 1 to 9 and a charger. " * 3
    return (SYSTEM, ChatMessage("user", scene + f"Task {turn}: bring tote {turn} to the dock."))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[DaemonProcess]:
    tmp = tmp_path_factory.mktemp("cluster")
    cfg = tmp / "cluster.toml"
    cfg.write_text(CONFIG.format(tmp=tmp / "ray"))
    d = DaemonProcess("cloudd", ["cluster", "serve", "--config", str(cfg), "--zmq-port", "0", "--http-port", "0"],
                      ready="cloudd cluster ready:", timeout_s=240)
    yield d
    assert d.terminate() == 0, d.log()


@pytest.fixture
def client(cluster) -> Iterator[FleetClient]:
    with FleetClient(cluster.fields["zmq"]) as c:
        yield c


def replicas(client: FleetClient) -> list[dict]:
    return client.stats(30)["cluster"]["replicas"]


def running_replica(client: FleetClient) -> dict:
    """The stats row of a replica running a request (a replica slow to answer misses a round)."""
    for _ in range(10):
        busy = [r for r in replicas(client) if r["running"]]
        if busy:
            return busy[0]
    raise AssertionError("no replica reports a running request")


def test_each_robot_stays_on_one_replica_and_robots_spread(client):
    before = {r["replica"]: r["routed"] for r in replicas(client)}
    for turn in range(2):
        calls = [client.start(Generate(f"{robot}-{turn}", messages=task(robot, turn), robot_id=robot,
                                       sampling=Sampling(max_tokens=4))) for robot in ("r1", "r2", "r3", "r4")]
        assert all(c.result(120).finish_reason in ("length", "stop") for c in calls)
    snap = client.stats(30)
    router = snap["cluster"]["router"]
    assert router["moves"] == 0, router  # the second turns went where the first ones had
    routed = {r["replica"]: r["routed"] - before.get(r["replica"], 0) for r in snap["cluster"]["replicas"]}
    assert sorted(routed.values()) == [4, 4], routed  # four robots, two per replica
    assert sum(r["prefix_hits"] for r in snap["cluster"]["replicas"]) >= 4


def test_a_replica_killed_mid_stream_loses_nothing(client):
    call = client.start(Generate("kill-1", messages=task("k", 1), robot_id="k", stream=True,
                                 sampling=Sampling(max_tokens=60, ignore_eos=True)))
    chunks, result = [], None
    for reply in call.events(180):
        if isinstance(reply, Chunk):
            chunks.append(reply)
            if len(chunks) == 5:
                os.kill(running_replica(client)["pid"], signal.SIGKILL)
        else:
            result = reply
    assert isinstance(result, Result) and result.finish_reason == "length", result
    assert [c.seq for c in chunks] == list(range(len(chunks)))  # each chunk once, in order
    assert [t for c in chunks for t in c.token_ids] == list(result.token_ids)
    assert len(result.token_ids) == result.usage.completion_tokens == 60
    assert "".join(c.text for c in chunks) == result.text
    assert client.stats(30)["cluster"]["resumed"] >= 1
    again = client.generate(Generate("kill-1", messages=task("k", 1), robot_id="k", stream=True,
                                     sampling=Sampling(max_tokens=60, ignore_eos=True)), timeout_s=30)
    assert again == result  # the front's ledger: a retry gets the same result, nothing runs twice
    deadline = time.monotonic() + 300  # a busy 2-core machine took 2 minutes to start one
    while len(replicas(client)) < 2:  # Ray restarts the dead replica
        assert time.monotonic() < deadline, "the killed replica was not restarted"
        time.sleep(1)


def test_safety_is_served_ahead_of_a_full_cluster(client):
    """4 running per replica (max_num_seqs) and more waiting: a safety request still starts at once."""
    slow = [client.start(Generate(f"bg-{i}", messages=task(f"b{i}", 1), robot_id=f"b{i}",
                                  priority=Priority.BACKGROUND, sampling=Sampling(max_tokens=40, ignore_eos=True)))
            for i in range(12)]
    time.sleep(1.0)
    urgent = client.generate(Generate("stop-now", messages=task("s", 1), robot_id="s", priority=Priority.SAFETY,
                                      sampling=Sampling(max_tokens=4, ignore_eos=True)), timeout_s=120)
    pending = sum(not c.done.is_set() for c in slow)
    assert urgent.finish_reason == "length" and pending >= 4, pending  # it did not wait for the background work
    for c in slow:
        c.result(300)


def test_the_openai_client_through_the_cluster(cluster):
    from openai import OpenAI

    api = OpenAI(base_url=cluster.fields["http"] + "/v1", api_key="unused")
    reply = api.chat.completions.create(model="any", messages=[{"role": "user", "content": "Say hello"}],
                                        max_tokens=8, temperature=0)
    assert reply.choices[0].message.content and reply.usage.completion_tokens <= 8
    stream = api.chat.completions.create(model="any", messages=[{"role": "user", "content": "Say hello"}],
                                         max_tokens=8, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_cluster_status_and_fleetctl_show_every_replica(cluster):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "cloudd", "cluster", "status", "--endpoint", cluster.fields["zmq"]],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "replicas" in out.stdout and "router fleet" in out.stdout
    status = subprocess.run([sys.executable, "-m", "cloudd.fleetctl", "status", "--endpoint", cluster.fields["zmq"],
                             "--timeout", "30"], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and "replicas" in status.stdout, status.stderr
