"""A Ray cluster of two nodes on this machine, run by ``test_cluster_process.py`` inside a
loopback-only network namespace: a head and a worker started with ``ray start`` (one CPU and a
resource of its own each), ``cloudd cluster serve`` joining them through ``[cluster] address``
with 2 replicas of one CPU each (so Ray puts one on each node), and the worker node's processes
(its raylet and every process under it, the replica among them) killed mid-stream: every request
finishes once, in order, its replica's requests resumed on the head node's replica."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from shared.daemon_process import DaemonProcess
from shared.protocol.messages import Chunk, Generate, Result, Sampling
from shared.transport.client import FleetClient
from tests.cluster.cases_in_netns import REPLICA_TABLES, task

GCS_PORT = 6390  # the namespace has its own ports: nothing else listens there
NODE_START_S = 120.0
# a loopback-only namespace: clusters allowed (only 127.0.0.1 exists to resolve to), no token
# (the namespace is the boundary; docs/cluster.md says to keep Ray's token auth on real machines)
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "HTTP_PROXY": "http://127.0.0.1:9",
           "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": "localhost,127.0.0.1,::1"}
CONFIG = """
[cluster]
address = "127.0.0.1:{port}"
replicas = 2
num_cpus_per_replica = 1.0
health_check_period_s = 1.0
""" + REPLICA_TABLES


@dataclass
class RayNode:
    """One ``ray start --block`` (its own session, so that it is stopped by its own id)."""

    name: str
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, name: str, temp_dir: Path, head: bool) -> RayNode:
        where = ["--head", "--port", str(GCS_PORT), "--include-dashboard", "false"] if head else \
            ["--address", f"127.0.0.1:{GCS_PORT}"]
        args = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", *where, "--node-ip-address",
                "127.0.0.1", "--num-cpus", "1", "--resources", f'{{"{name}": 1}}', "--disable-usage-stats",
                "--temp-dir", str(temp_dir)]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **RAY_ENV}, start_new_session=True)
        node = cls(name, proc)
        started = threading.Event()

        def read() -> None:
            for line in proc.stdout:
                node.lines.append(line.rstrip("\n"))
                if "Ray runtime started" in line:
                    started.set()
            started.set()

        threading.Thread(target=read, daemon=True).start()
        if not started.wait(NODE_START_S) or proc.poll() is not None:
            node.kill()
            raise RuntimeError(f"ray node {name} did not start:\n" + "\n".join(node.lines[-40:]))
        return node

    def pids(self) -> set[int]:
        """Every process this node runs: its raylet, agents and workers (replicas among them)."""
        try:
            return {self.proc.pid, *(p.pid for p in psutil.Process(self.proc.pid).children(recursive=True))}
        except psutil.NoSuchProcess:
            return set()

    def kill(self) -> None:
        """SIGKILL each of its processes, by id (the node dies; a test's node holds nothing to
        save, and Ray's own drain on SIGTERM takes up to 30 s)."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[tuple[RayNode, RayNode, DaemonProcess]]:
    os.environ.update(RAY_ENV)  # for cloudd cluster serve, which joins them
    temp = Path(tempfile.mkdtemp(prefix="fsn", dir="/tmp"))  # short: Ray's socket paths have a length limit
    cfg = temp / "cluster.toml"
    cfg.write_text(CONFIG.format(port=GCS_PORT))
    nodes: list[RayNode] = []
    daemon = None
    try:
        nodes.append(RayNode.start("node_head", temp / "h", head=True))
        nodes.append(RayNode.start("node_worker", temp / "w", head=False))
        daemon = DaemonProcess("cloudd", ["cluster", "serve", "--config", str(cfg), "--zmq-port", "0",
                                          "--http-port", "0"], ready="cloudd cluster ready:", timeout_s=240)
        yield nodes[0], nodes[1], daemon
        assert daemon.terminate() == 0, daemon.log()
    finally:
        if daemon is not None:
            daemon.kill()
        for node in reversed(nodes):
            node.kill()
        shutil.rmtree(temp, ignore_errors=True)


def test_the_worker_node_killed_mid_stream_every_request_finishes_once(two_nodes):
    head, worker, daemon = two_nodes
    with FleetClient(daemon.fields["zmq"]) as client:
        assert daemon.fields["ray"] == f"127.0.0.1:{GCS_PORT}"  # joined, not started here
        rows = client.stats(60)["cluster"]["replicas"]
        on_head = [r for r in rows if r["pid"] in head.pids()]
        on_worker = [r for r in rows if r["pid"] in worker.pids()]
        assert len(on_head) == len(on_worker) == 1, (rows, head.pids(), worker.pids())  # one replica per node

        robots = ("r1", "r2", "r3", "r4")  # the fleet router spreads them, two a replica
        requests = {r: Generate(f"node-{r}", messages=task(r, 1), robot_id=r, stream=True,
                                sampling=Sampling(max_tokens=64, ignore_eos=True)) for r in robots}
        calls = {r: client.start(req) for r, req in requests.items()}
        replies: dict[str, list] = {r: [] for r in robots}
        streaming = threading.Barrier(len(robots) + 1)

        def consume(robot: str) -> None:
            waiting = True
            for reply in calls[robot].events(240):
                replies[robot].append(reply)
                if waiting and sum(isinstance(x, Chunk) for x in replies[robot]) >= 3:
                    waiting = False
                    streaming.wait(240)
            if waiting:  # ended before its third chunk: do not hold the others up
                streaming.wait(240)

        readers = [threading.Thread(target=consume, args=(r,)) for r in robots]
        for t in readers:
            t.start()
        streaming.wait(240)  # every stream is under way
        worker.kill()
        for t in readers:
            t.join(300)
        for robot in robots:
            chunks = [x for x in replies[robot] if isinstance(x, Chunk)]
            ends = [x for x in replies[robot] if not isinstance(x, Chunk)]
            assert len(ends) == 1 and isinstance(ends[0], Result), (robot, ends)  # it finished, once
            result = ends[0]
            assert result.finish_reason == "length" and len(result.token_ids) == 64, result
            assert [c.seq for c in chunks] == list(range(len(chunks)))  # each chunk once, in order
            assert [t for c in chunks for t in c.token_ids] == list(result.token_ids)
            assert "".join(c.text for c in chunks) == result.text
            assert client.generate(requests[robot], timeout_s=60) == result  # a retry: kept, not run again
        snap = client.stats(60)["cluster"]
        assert snap["resumed"] >= 1, snap  # the worker node's requests went on on the head's replica
        assert [r["pid"] for r in snap["replicas"]] == [on_head[0]["pid"]], snap["replicas"]
