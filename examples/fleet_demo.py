"""The whole system on one machine (``make demo``): cloudd and edged linked with CURVE, three
plan requests from robot_sdk, ``fleetctl status``, then a clean stop.

1. a plain plan for the robot: edged answers it on the robot from its pinned prompt;
2. a plan tagged ``multi-floor``: edged's config escalates that tag to cloudd;
3. an urgent ``safety`` plan with a deadline, sent while the first lane may be busy.

Everything listens on loopback or an ipc socket under a temporary directory; keys are created
there too. Run it with ``python examples/fleet_demo.py`` from the repository root.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from robot_sdk import Place, Plan, PlanClient, Scene, Thing, skill
from shared.daemon_process import DaemonProcess
from shared.transport.curve import create_keys

ROOT = Path(__file__).resolve().parents[1]
# What the robot sees: a grounded argument (Place, Thing) can name only these, whatever the model writes.
SCENE = Scene(places=("charging dock 2", "waypoint 17", "aisle 4", "shelf A3", "elevator"),
              objects=("tote 12", "shelf A3"),
              notes="Robot amr-030, battery 58 percent, at charging dock 2. Tote 12 is on waypoint 17. "
                    "Shelf A3 is in aisle 4.")


@skill
def goto(waypoint: Place) -> None:
    """drive to a named waypoint"""


@skill
def lift(load: Thing) -> None:
    """lift the shelf or tote under the robot"""


@skill
def lower(load: Thing) -> None:
    """lower the carried shelf or tote"""


@skill
def report(message: str) -> None:
    """send a status message to the fleet manager"""


SKILLS = [goto, lift, lower, report]


def configs(tmp: Path, cloud_port: int, pinned_prompt: str) -> tuple[Path, Path]:
    server_public, server_secret = create_keys(tmp / "keys/server", "cloudd")
    _, robot_secret = create_keys(tmp / "keys/authorized", "amr-030")
    create_keys(tmp / "keys/authorized", "operator")  # fleetctl's key
    cloudd = tmp / "cloudd.toml"
    cloudd.write_text(_with_curve(ROOT / "configs/cloudd.toml", server_secret, tmp / "keys/authorized"))
    edged = tmp / "edged.toml"
    edged.write_text(f"""
[backend]
kind = "onnx"
quant = "int4"
max_len = 2048
threads = 2
[serve]
robot_id = "amr-030"
endpoints = ["ipc://{tmp}/edged.sock", "tcp://127.0.0.1:0"]
[escalation]
cloud_endpoint = "tcp://127.0.0.1:{cloud_port}"
server_public_key = "{server_public}"
robot_secret_key = "{robot_secret}"
escalate_tags = ["multi-floor"]
min_mean_logprob = -3.0
[[pinned]]
name = "amr"
text = '''{pinned_prompt}'''
""")
    return cloudd, edged


def _with_curve(base: Path, server_secret: Path, authorized: Path) -> str:
    """cloudd's shipped config with CURVE switched on in its [serve] table."""
    text = base.read_text()
    lines = f'curve_secret_key = "{server_secret}"\ncurve_authorized_dir = "{authorized}"\n'
    return text.replace("[serve]\n", "[serve]\n" + lines, 1)


def show(title: str, plan: Plan) -> None:
    where = plan.source + (" (degraded: the cloud could not answer)" if plan.degraded else "")
    why = f", escalated: {plan.escalation_reason}" if plan.escalation_reason else ""
    timings = ", ".join(f"{k} {v:.2f} s" for k, v in plan.timings.items() if k in ("ttft_s", "e2e_s", "cloud_s"))
    print(f"\n== {title}\n   answered on: {where}{why}\n   timings: {timings}")
    for i, step in enumerate(plan.steps, 1):
        print(f"   {i}. {step.skill} {step.args}")
    grounded = {"waypoint": SCENE.places, "load": SCENE.objects}
    unknown = [v for step in plan.steps for k, v in step.args.items() if k in grounded and v not in grounded[k]]
    assert not unknown, f"a plan named something outside the scene: {unknown}"  # the grammar makes this impossible
    print(f"   done: {plan.done}, confidence: {plan.confidence}")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="fleetserve-demo-") as d:
        tmp = Path(d)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            cloud_port = s.getsockname()[1]
        robot = PlanClient(f"ipc://{tmp}/edged.sock", robot_id="amr-030", timeout_s=300)
        # edged pins exactly the system prompt the SDK sends for these skills
        cloudd_cfg, edged_cfg = configs(tmp, cloud_port, robot.system_prompt(SKILLS))
        print("starting cloudd (the fleet daemon) and edged (the robot daemon; the first start exports "
              "the model to ONNX int4, about a minute)...", flush=True)
        cloudd = DaemonProcess("cloudd", ["serve", "--config", str(cloudd_cfg), "--zmq-port", str(cloud_port),
                                          "--http-port", "0"], ready="cloudd ready:")
        edged = None
        try:
            edged = DaemonProcess("edged", ["serve", "--config", str(edged_cfg)], ready="edged ready:", timeout_s=600)
            print(cloudd.lines[-1], "\n" + edged.lines[-1], flush=True)
            with robot:
                show("1. a plan for the robot", robot.plan(
                    "bring tote 12 from waypoint 17 to shelf A3.", scene=SCENE, skills=SKILLS, max_steps=3, max_tokens=300))
                show("2. a multi-floor plan (escalated by tag)", robot.plan(
                    "bring tote 12 to the second floor.", scene=SCENE, skills=SKILLS, max_steps=3, max_tokens=300,
                    tags=["multi-floor"]))
                show("3. an urgent safety plan with a 20 s deadline", robot.plan(
                    "a person is in aisle 4: stop and report.", scene=SCENE, skills=SKILLS, max_steps=3, max_tokens=300,
                    priority="safety", deadline_ms=20_000))
            print("\n== fleetctl status (cloudd)", flush=True)
            subprocess.run([sys.executable, "-m", "cloudd.fleetctl", "status", "--endpoint",
                            f"tcp://127.0.0.1:{cloud_port}", "--server-key", str(tmp / "keys/server/cloudd.key"),
                            "--key", str(tmp / "keys/authorized/operator.key_secret")], check=False)
        finally:
            for daemon in (edged, cloudd):
                if daemon is not None:
                    code = daemon.terminate()
                    print(f"{daemon.module} stopped (exit {code})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
