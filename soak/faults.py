"""The fault matrix: each fault is injected while real plans are in flight, then the harness waits
for every plan's one answer and checks the fleet once it is idle again (``check_fleet``).

| fault | plans in flight | what is done |
|---|---|---|
| ``cloudd_kill`` | at cloudd and escalated by edged | SIGKILL mid-stream, restart on the same address |
| ``cloudd_freeze`` | at cloudd and escalated | SIGSTOP past the heartbeat timeout, then SIGCONT |
| ``link_drop`` | escalated by edged, local | the robot's link closed and refused for 5 s |
| ``link_blackhole`` | escalated, local | the link swallows every byte for 5 s |
| ``link_delay`` | escalated, local | 300 ms added each way for 8 s |
| ``edged_kill`` | local at edged, escalated | SIGKILL edged, restart: pinned KV read back from disk |
| ``disk_faults`` | at cloudd, new prompts | the disk tier's writes fail (its directory turns into a file); then every page file is torn in half and cloudd restarted, and the same prompts come again |
| ``overload`` | 10 plans a second for 8 s, deadlines 4-10 s | ten times the soak's base rate of one plan a second |
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from soak.fleet import EDGE_ROBOT, ESCALATE_TAG, Fleet
from soak.link_proxy import LinkMode
from soak.plans import TASKS, PlanAsk, Traffic

LEAD_S = 1.5  # plans are under way (prefilled, streaming) when a fault strikes


@dataclass(frozen=True)
class Fault:
    name: str
    asks: Callable[[Fleet], list[PlanAsk]]
    inject: Callable[[Fleet, Traffic], None]  # returns once the fault is over (and the daemon restarted)


def _mixed(fleet: Fleet) -> list[PlanAsk]:
    """Plans at cloudd from each direct robot (half with a deadline) and two escalated by edged."""
    direct = [PlanAsk(robot, TASKS[i % len(TASKS)], deadline_ms=60_000 if i % 2 else None)
              for i, robot in enumerate(fleet.direct_robots)]
    return direct + [PlanAsk(EDGE_ROBOT, task, tags=(ESCALATE_TAG,)) for task in TASKS[:2]]


def _at_edge(fleet: Fleet) -> list[PlanAsk]:
    """Three plans escalated over the robot's link (with deadlines) and one answered on the robot."""
    return [PlanAsk(EDGE_ROBOT, task, deadline_ms=30_000, tags=(ESCALATE_TAG,)) for task in TASKS[:3]] + \
        [PlanAsk(EDGE_ROBOT, TASKS[3])]


def _local_at_edge(fleet: Fleet) -> list[PlanAsk]:
    return [PlanAsk(EDGE_ROBOT, task) for task in TASKS[:3]] + [PlanAsk(EDGE_ROBOT, TASKS[3], tags=(ESCALATE_TAG,))]


def _kill_cloudd(fleet: Fleet, traffic: Traffic) -> None:
    fleet.cloudd.kill()
    time.sleep(1.0)
    fleet.start_cloudd()


def _freeze_cloudd(fleet: Fleet, traffic: Traffic) -> None:
    fleet.freeze(fleet.cloudd)
    time.sleep(fleet.tuning.link_timeout_s + 3.0)
    fleet.thaw(fleet.cloudd)


def _link(mode: LinkMode, seconds: float, delay_s: float = 0.0) -> Callable[[Fleet, Traffic], None]:
    def inject(fleet: Fleet, traffic: Traffic) -> None:
        fleet.proxy.set_mode(mode, delay_s)
        time.sleep(seconds)
        fleet.proxy.set_mode(LinkMode.PASS)
    return inject


def _kill_edged(fleet: Fleet, traffic: Traffic) -> None:
    fleet.edged.kill()
    time.sleep(0.5)
    fleet.start_edged()


def _disk_faults(fleet: Fleet, traffic: Traffic) -> None:
    """Writes fail while new prompts come in (their pages cannot be spilled); then every page on
    disk is torn in half and cloudd restarted (its device and host tiers empty), so that the
    same prompts again must read the torn pages, find them torn and recompute."""
    aside = fleet.disk_dir.with_name("kv-disk-aside")
    fleet.disk_dir.rename(aside)
    fleet.disk_dir.write_text("not a directory: every page write fails")
    for i, robot in enumerate(fleet.direct_robots):
        traffic.send(PlanAsk(robot, f"{TASKS[i % len(TASKS)]} Then report to desk {i + 100}.", deadline_ms=60_000))
    time.sleep(6.0)
    fleet.disk_dir.unlink()
    aside.rename(fleet.disk_dir)
    traffic.join()
    with fleet.operator() as operator:  # before the restart resets them
        fleet.disk_write_errors += (operator.stats(timeout_s=10).get("tiers") or {}).get("copy_errors", 0)
    fleet.torn_pages += _tear_pages(fleet.disk_dir)
    fleet.cloudd.terminate()
    fleet.start_cloudd()
    for i, robot in enumerate(fleet.direct_robots):  # prompts whose pages were on disk, now torn
        traffic.send(PlanAsk(robot, TASKS[i % len(TASKS)], deadline_ms=60_000))


def _tear_pages(directory: Path) -> int:
    n = 0
    for page in directory.rglob("*.kv"):
        size = page.stat().st_size
        with open(page, "r+b") as f:
            f.truncate(size // 2)
        n += 1
    return n


def _overload(fleet: Fleet, traffic: Traffic) -> None:
    robots = [*fleet.direct_robots, EDGE_ROBOT]
    priorities = ("plan", "interactive", "background", "safety")
    for i in range(80):
        traffic.send(PlanAsk(robots[i % len(robots)], TASKS[i % len(TASKS)], deadline_ms=4_000 + 750 * (i % 9),
                             priority=priorities[i % len(priorities)]))
        time.sleep(0.1)


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("cloudd_kill", _mixed, _kill_cloudd),
    Fault("cloudd_freeze", _mixed, _freeze_cloudd),
    Fault("link_drop", _at_edge, _link(LinkMode.DROP, 5.0)),
    Fault("link_blackhole", _at_edge, _link(LinkMode.BLACKHOLE, 5.0)),
    Fault("link_delay", _at_edge, _link(LinkMode.DELAY, 8.0, delay_s=0.3)),
    Fault("edged_kill", _local_at_edge, _kill_edged),
    Fault("disk_faults", lambda fleet: [], _disk_faults),
    Fault("overload", lambda fleet: [], _overload),
)}


def run_fault(fault: Fault, fleet: Fleet, traffic: Traffic) -> list:
    """Send the fault's plans, strike while they run, and return every plan's outcome."""
    for ask in fault.asks(fleet):
        traffic.send(ask)
    time.sleep(LEAD_S)
    fault.inject(fleet, traffic)
    return traffic.wait()


def restore_disk_dir(fleet: Fleet) -> None:
    """Undo a disk fault that an error interrupted (the harness must leave the tier usable)."""
    aside = fleet.disk_dir.with_name("kv-disk-aside")
    if aside.exists():
        if fleet.disk_dir.is_file():
            fleet.disk_dir.unlink()
        elif fleet.disk_dir.is_dir():
            shutil.rmtree(fleet.disk_dir)
        aside.rename(fleet.disk_dir)
