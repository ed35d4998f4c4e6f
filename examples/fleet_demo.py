"""The whole system on one machine (``make demo``): cloudd and edged linked with CURVE, three
plan requests from robot_sdk, ``fleetctl status``, then a clean stop.

1. a plain plan for the robot: edged answers it on the robot from its pinned prompt;
2. the same task escalated (``escalation="cloud"``; edged's config also escalates tags such as
   ``multi-floor``) to cloudd, which serves a larger model than the robot's (the shipped
   config's Qwen2.5-Coder-1.5B against the robot's SmolLM2-135M); the robot's own plan is shown
   beside the cloud's, with both times: what escalating bought, and what it cost;
3. an urgent ``safety`` plan with a deadline, sent while the first lane may be busy.

Everything listens on loopback or an ipc socket under a temporary directory; keys are created
there too. Run it with ``python examples/fleet_demo.py`` from the repository root.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from robot_sdk import Place, Plan, PlanClient, Scene, Thing, skill
from shared.daemon_process import DaemonProcess
from shared.transport.curve import create_keys
from shared.transport.loopback import free_port

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
# The demo's plan requests: (name, task, max_steps). The first is answered on the robot and
# escalated; the second is the urgent one (cloudd.llamacpp_agreement checks the model on both).
TOTE_TASK = ("tote", "bring tote 12 from waypoint 17 to shelf A3.", 4)
SAFETY_TASK = ("safety", "a person is in aisle 4: stop and report.", 3)


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
endpoints = ["ipc://{tmp}/edged.sock"]
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
        print(f"   {i}. {step_text(step)}")
    print(f"   done: {plan.done}, confidence: {plan.confidence}")


def show_side_by_side(title: str, robot: Plan, cloud: Plan) -> None:
    """The robot's own plan and the escalated one for the same task in two columns, each with the
    seconds its request took as the robot's client saw them."""
    width = 46
    print(f"\n== {title}")
    heads = (f"on the robot ({robot.source})", f"escalated ({cloud.source}{', degraded' if cloud.degraded else ''})")
    print("   " + "".join(h.ljust(width) for h in heads))
    print("   " + "".join(f"{p.timings['client_e2e']:.2f} s, done: {p.done}".ljust(width) for p in (robot, cloud)))
    for i in range(max(len(robot.steps), len(cloud.steps))):
        cells = [f"{i + 1}. {step_text(p.steps[i])}" if i < len(p.steps) else "" for p in (robot, cloud)]
        print("   " + "".join(c.ljust(width) for c in cells))
    print(f"   the plans {'differ' if robot.steps != cloud.steps else 'are the same'}")


def step_text(step) -> str:
    """``goto waypoint 17``: a step as one line. Asserts that every argument the scene grounds is in
    the scene (the grammar makes anything else impossible)."""
    grounded = {"waypoint": SCENE.places, "load": SCENE.objects}
    unknown = [v for k, v in step.args.items() if k in grounded and v not in grounded[k]]
    assert not unknown, f"a plan named something outside the scene: {unknown}"
    return " ".join([step.skill, *map(str, step.args.values())])


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="fleetserve-demo-") as d:
        tmp = Path(d)
        cloud_port = free_port()
        robot = PlanClient(f"ipc://{tmp}/edged.sock", robot_id="amr-030", timeout_s=300)
        # edged pins exactly the system prompt the SDK sends for these skills
        cloudd_cfg, edged_cfg = configs(tmp, cloud_port, robot.system_prompt(SKILLS))
        print("starting cloudd (the fleet daemon, Qwen2.5-Coder-1.5B) and edged (the robot daemon, "
              "SmolLM2-135M; the first start exports it to ONNX int4, about a minute)...", flush=True)
        cloudd = DaemonProcess("cloudd", ["serve", "--config", str(cloudd_cfg), "--zmq-port", str(cloud_port),
                                          "--http-port", "0"], ready="cloudd ready:", timeout_s=900)
        edged = None
        try:
            edged = DaemonProcess("edged", ["serve", "--config", str(edged_cfg)], ready="edged ready:", timeout_s=600)
            print(cloudd.lines[-1], "\n" + edged.lines[-1], flush=True)
            with robot:
                _, task, steps = TOTE_TASK
                on_robot = robot.plan(task, scene=SCENE, skills=SKILLS, max_steps=steps, escalation="local")
                show("1. a plan for the robot", on_robot)
                show_side_by_side(f"2. the same task escalated to the fleet's model: {task!r}", on_robot,
                                  robot.plan(task, scene=SCENE, skills=SKILLS, max_steps=steps, escalation="cloud"))
                _, task, steps = SAFETY_TASK
                show("3. an urgent safety plan with a 20 s deadline", robot.plan(
                    task, scene=SCENE, skills=SKILLS, max_steps=steps, priority="safety", deadline_ms=20_000))
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
