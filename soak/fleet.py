"""The fleet the soak harness runs: a real ``cloudd serve`` and ``edged serve`` on loopback, CURVE
on, edged's cloud link through a ``LinkProxy``, with keys, configs, journals and disk tiers under
one temporary directory. It can kill, freeze, thaw and restart either daemon on the same
addresses (SIGKILL is ``DaemonProcess.kill``).

Robots: ``direct_robots`` talk to cloudd with their own keys; ``EDGE_ROBOT`` is edged's key (its
escalations); ``FUZZ_ROBOT`` is the fuzzer's key (an insider: authorized, and hostile); the
operator key watches (stats, health).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

from cloudd.api_keys import make_key
from robot_sdk import PlanClient
from robot_sdk.prompt import system_prompt
from robot_sdk.skills import as_skills
from shared.daemon_process import DaemonProcess
from shared.transport.client import ClientConfig, FleetClient
from shared.transport.curve import ClientCurve, create_keys
from shared.transport.loopback import free_port
from soak.link_proxy import LinkProxy
from soak.plans import MAX_STEPS, SKILLS

EDGE_ROBOT = "amr-edge"
FUZZ_ROBOT = "fuzzbot"
ESCALATE_TAG = "multi-floor"


@dataclass(frozen=True)
class FleetTuning:
    """What the harness changes from the shipped configs, and why."""

    link_timeout_s: float = 2.0  # edged gives a silent cloud up quickly: faults end in seconds
    http_timeout_s: float = 5.0  # half-sent HTTP requests are closed within the run
    num_blocks: int = 512  # a small device pool and host tier: pages reach the disk tier
    host_pool_mb: float = 24.0
    edge_threads: int = 1  # edged shares the two cores with cloudd and the harness


class Fleet:
    def __init__(self, root: Path, direct_robots: list[str], tuning: FleetTuning = FleetTuning()):
        self.root = root
        self.direct_robots = direct_robots
        self.tuning = tuning
        keys = root / "keys"
        self.server_public, server_secret = create_keys(keys / "server", "cloudd")
        self.robot_secret = {name: create_keys(keys / "authorized", name)[1]
                             for name in [*direct_robots, EDGE_ROBOT, FUZZ_ROBOT]}
        _, self.operator_secret = create_keys(keys / "operators", "operator")
        self.api_key = make_key(root / "api_keys.toml", "soak")
        self.zmq_port, self.http_port = free_port(), free_port()
        self.cloudd_endpoint = f"tcp://127.0.0.1:{self.zmq_port}"
        self.http_base = f"http://127.0.0.1:{self.http_port}"
        self.proxy = LinkProxy(self.zmq_port)
        self.proxy.start()
        self.edged_endpoint = f"ipc://{root}/edged.sock"
        self.cloudd_journal, self.edged_journal = root / "cloudd-executions.jsonl", root / "edged-executions.jsonl"
        self.disk_dir = root / "kv-disk"
        self.pinned_dir = root / "pinned"
        self._cloudd_config = self._write_cloudd_config(server_secret, keys)
        self._edged_config = self._write_edged_config()
        self.cloudd: DaemonProcess | None = None
        self.edged: DaemonProcess | None = None
        self.exits: list[str] = []  # daemons found dead that the harness did not kill
        self.torn_pages = 0  # page files the disk fault tore
        self.disk_write_errors = 0  # page writes that failed while the disk fault blocked them

    # --- configs ---------------------------------------------------------------------------------

    def _write_cloudd_config(self, server_secret: Path, keys: Path) -> Path:
        t = self.tuning
        path = self.root / "cloudd.toml"
        path.write_text(f"""
[engine]
dtype = "float32"
compile = false
num_blocks = {t.num_blocks}
[scheduler]
max_num_seqs = 64
[hicache]
enabled = true
host_pool_mb = {t.host_pool_mb}
disk_dir = "{self.disk_dir}"
[serve]
zmq_port = {self.zmq_port}
http_port = {self.http_port}
curve_secret_key = "{server_secret}"
curve_authorized_dir = "{keys / 'authorized'}"
curve_operator_dir = "{keys / 'operators'}"
http_api_keys = "{self.root / 'api_keys.toml'}"
http_timeout_s = {t.http_timeout_s}
stall_after_s = 5.0
frames_per_s = 0.0  # the fuzzer's million frames must reach the decoder, not be dropped unread by its sender's rate
shutdown_grace_s = 5.0
execution_log = "{self.cloudd_journal}"
precompile = ["fleet-plan"]
[serve.priority_grants]
"amr-*" = ["safety", "interactive", "plan", "background"]  # the robots, as shipped; fuzzbot gets the default
""")
        return path

    def _write_edged_config(self) -> Path:
        t = self.tuning
        pinned = system_prompt(as_skills(SKILLS), None, MAX_STEPS, None)  # what PlanClient.plan sends
        path = self.root / "edged.toml"
        path.write_text(f"""
[backend]
kind = "onnx"
quant = "int4"
max_len = 2048
threads = {t.edge_threads}
[serve]
robot_id = "{EDGE_ROBOT}"
endpoints = ["{self.edged_endpoint}"]
pinned_dir = "{self.pinned_dir}"
execution_log = "{self.edged_journal}"
shutdown_grace_s = 5.0
[escalation]
cloud_endpoint = "tcp://127.0.0.1:{self.proxy.port}"
server_public_key = "{self.server_public}"
robot_secret_key = "{self.robot_secret[EDGE_ROBOT]}"
escalate_tags = ["{ESCALATE_TAG}"]
# escalation by tag only: the fault matrix chooses which plans cross the link (faults.py)
min_mean_logprob = -100.0
check_task_names = false
link_timeout_s = {t.link_timeout_s}
heartbeat_s = 0.5
breaker_cooldown_s = 2.0
[[pinned]]
name = "soak"
text = '''{pinned}'''
""")
        return path

    # --- daemons ---------------------------------------------------------------------------------

    def start_cloudd(self) -> None:
        self.cloudd = DaemonProcess("cloudd", ["serve", "--config", str(self._cloudd_config)], ready="cloudd ready:")

    def start_edged(self) -> None:
        self.edged = DaemonProcess("edged", ["serve", "--config", str(self._edged_config)], ready="edged ready:",
                                   timeout_s=600)

    def freeze(self, daemon: DaemonProcess) -> None:
        daemon.proc.send_signal(signal.SIGSTOP)

    def thaw(self, daemon: DaemonProcess) -> None:
        daemon.proc.send_signal(signal.SIGCONT)

    def check_alive(self) -> None:
        """Record a daemon that exited without the harness killing it (a crash), then restart it."""
        for name, daemon, start in (("cloudd", self.cloudd, self.start_cloudd), ("edged", self.edged, self.start_edged)):
            if daemon is not None and daemon.proc.poll() is not None:
                self.exits.append(f"{name} exited with {daemon.proc.returncode}: {daemon.log()[-2000:]}")
                start()

    def stop(self) -> list[int]:
        codes = []
        for daemon in (self.edged, self.cloudd):
            if daemon is not None:
                self.thaw(daemon)
                codes.append(daemon.terminate())
        self.proxy.close()
        return codes

    # --- clients ---------------------------------------------------------------------------------

    def curve_for(self, robot: str) -> ClientCurve:
        return ClientCurve.from_files(self.server_public, self.robot_secret[robot])

    def operator_curve(self) -> ClientCurve:
        return ClientCurve.from_files(self.server_public, self.operator_secret)

    def operator(self) -> FleetClient:
        """A client with the operator's key at cloudd (stats see every robot)."""
        return FleetClient(self.cloudd_endpoint, ClientConfig(timeout_s=10, curve=self.operator_curve()))

    def robot_client(self, robot: str, timeout_s: float = 5.0, retries: int = 6) -> PlanClient:
        """A robot's plan client: at cloudd directly with its key, or at edged for ``EDGE_ROBOT``."""
        if robot == EDGE_ROBOT:
            return PlanClient(self.edged_endpoint, robot_id=EDGE_ROBOT, timeout_s=timeout_s, retries=retries)
        return PlanClient(self.cloudd_endpoint, robot_id=robot, timeout_s=timeout_s, retries=retries,
                          curve=self.curve_for(robot))
