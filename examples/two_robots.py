"""Two robots, one planner: priorities and escalation with the asyncio client.

A warehouse AMR asks for a routine re-plan at background priority and keeps it on the robot
(escalation "local"); meanwhile a mobile manipulator gets a safety stop and asks at safety
priority with a deadline, letting edged escalate to the cloud when it judges it should
("auto"; "cloud" forces it). Both requests are in flight at once: the daemon serves the
safety one first. Each result says which tier answered (source), whether it is edged's
fallback (degraded) and why it escalated.

    cloudd serve --config configs/cloudd.toml &
    python examples/two_robots.py                                  # both robots on one daemon
    python examples/two_robots.py --amr tcp://amr-1:5555 --arm tcp://arm-2:5555   # each its edged
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Literal

from robot_sdk import AsyncPlanClient, Plan, PlanError, skill


@skill
def goto(waypoint: str) -> None:
    """drive to a named waypoint in the warehouse map"""


@skill
def lift(load: Literal["shelf", "pallet"]) -> None:
    """lift the shelf or pallet under the robot"""


@skill
def lower(location: str) -> None:
    """lower the carried shelf or pallet"""


@skill
def stop_motion(reason: str) -> None:
    """stop all motion at once and hold position"""


@skill
def retreat(location: str) -> None:
    """move the base slowly away to a safe location"""


@skill
def report(status: Literal["ok", "failed", "blocked"], message: str) -> None:
    """send a status message to the fleet manager"""


AMR_SKILLS = [goto, lift, lower, report]
ARM_SKILLS = [stop_motion, retreat, report]


async def amr(endpoint: str) -> Plan:
    async with AsyncPlanClient(endpoint, robot_id="amr-1") as client:
        return await client.plan("Move pallet 7 from the loading bay to shelf B1.",
                                 scene={"at": "loading bay", "carrying": "nothing", "battery": 61},
                                 skills=AMR_SKILLS, priority="background", escalation="local", max_steps=4)


async def arm(endpoint: str) -> Plan:
    async with AsyncPlanClient(endpoint, robot_id="arm-2") as client:
        await asyncio.sleep(0.2)  # the AMR's request is already queued when the stop comes in
        return await client.plan("STOP: a person entered the work zone next to the workbench; act safely.",
                                 scene={"at": "workbench", "holding": "screwdriver", "person": "0.8 m to the left"},
                                 skills=ARM_SKILLS, priority="safety", deadline_ms=15000, escalation="auto",
                                 max_steps=3)


def show(robot: str, outcome: Plan | BaseException) -> None:
    if isinstance(outcome, BaseException):
        print(f"{robot}: {type(outcome).__name__}: {outcome}")
        return
    t = outcome.timings
    print(f"{robot}: {outcome.source}{' (degraded fallback)' if outcome.degraded else ''}, "
          f"escalation: {outcome.escalation_reason or '-'}, queue {t.get('queue_s', 0):.2f} s, "
          f"first token {t.get('ttft_s', 0):.2f} s, total {t.get('client_e2e', 0):.2f} s")
    for i, step in enumerate(outcome.steps):
        print(f"  {i}. {step.skill} {step.args}")


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--amr", default="tcp://127.0.0.1:5555", help="the AMR's daemon")
    parser.add_argument("--arm", default=None, help="the manipulator's daemon (default: the AMR's)")
    args = parser.parse_args(argv)
    results = await asyncio.gather(amr(args.amr), arm(args.arm or args.amr), return_exceptions=True)
    for robot, outcome in zip(("amr-1 (background, local)", "arm-2 (safety, auto)"), results):
        show(robot, outcome)
    return 1 if any(isinstance(r, PlanError) for r in results) else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
