"""The soak's hostile-tenant phase: for each attack kind (``soak.attacks``), the victim robot
(``soak.victim``) streams plans for a window with no attacker (its baseline), then for a window
while one attacker with its own key runs that attack; ``soak.hostile_bar`` judges the two.

Each kind's baseline is measured just before its attack, after the previous kind has settled
(cloudd idle again), not once for the whole phase: on a shared two-core machine the background
load drifts over minutes, and a baseline taken next to its attack compares like with like.

Per kind (about ``baseline_s + attack_s + lead_s`` plus settling, ~25-35 s; twelve kinds fit in
about seven minutes): wait for cloudd to be idle, baseline window, start the attacker, let it
lead by ``lead_s``, attack window, stop the attacker (it cancels what it sent), record daemon
exits (crashes; the daemon is restarted).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

from soak.attacks import ATTACKS, Attack, AttackCounts, Target
from soak.fleet import FUZZ_ROBOT, Fleet
from soak.hostile_bar import KindResult
from soak.http_tenant import HttpTenant
from soak.victim import Victim

VICTIM_ROBOT = "amr-001"


@dataclass(frozen=True)
class HostileSettings:
    kinds: tuple[str, ...] = tuple(ATTACKS)
    baseline_s: float = 10.0
    attack_s: float = 12.0
    lead_s: float = 1.0  # the attack is under way when the victim's window opens


@dataclass(frozen=True)
class KindReport:
    result: KindResult
    entry: dict  # the soak JSON's ``hostile.<kind>``


def run_hostile(fleet: Fleet, settings: HostileSettings, wait_idle: Callable[[], object],
                log: Callable[[str], None] = print) -> list[KindReport]:
    """Run every kind of ``settings`` against ``fleet``'s cloudd; ``wait_idle`` returns once
    cloudd is idle (or has been given up on)."""
    victim = Victim(lambda: fleet.robot_client(VICTIM_ROBOT, timeout_s=10.0))
    target = Target(fleet.cloudd_endpoint, fleet.curve_for(FUZZ_ROBOT), FUZZ_ROBOT, fleet.http_port, fleet.api_key)
    log("hostile: warming the victim's plan path...")
    victim.run(5.0)
    reports = []
    for name in settings.kinds:
        reports.append(_one_kind(fleet, ATTACKS[name], target, victim, settings, wait_idle))
        log(f"hostile {name}: {reports[-1].entry}")
    return reports


def _one_kind(fleet: Fleet, attack: Attack, target: Target, victim: Victim, settings: HostileSettings,
              wait_idle: Callable[[], object]) -> KindReport:
    wait_idle()
    exits_before = len(fleet.exits)
    baseline = victim.run(settings.baseline_s)
    counts = AttackCounts()
    stop = threading.Event()
    attacker = threading.Thread(target=attack.run, args=(target, stop, counts), name=f"attack-{attack.name}",
                                daemon=True)
    began = time.monotonic()
    attacker.start()
    try:
        with HttpTenant(fleet.http_port, fleet.api_key) if attack.http else nullcontext() as tenant:
            stop.wait(settings.lead_s)
            attacked = victim.run(settings.attack_s)
    finally:
        stop.set()
        attacker.join(30.0)
    fleet.check_alive()
    result = KindResult(attack.name, tuple(attacked.gaps), tuple(baseline.gaps),
                        tuple(attacked.first_chunk_waits), tuple(baseline.first_chunk_waits),
                        crashes=len(fleet.exits) - exits_before, lost=baseline.lost + attacked.lost,
                        refused=attacked.refused + baseline.refused + (tenant.refused if tenant else 0))
    entry = {**result.as_dict(), "finding": attack.finding, "attack": counts.as_dict(),
             "victim_plans": attacked.plans, "victim_answers": dict(attacked.answers),
             "baseline_plans": baseline.plans, "baseline_answers": dict(baseline.answers),
             "attacker_stopped": not attacker.is_alive(), "seconds": round(time.monotonic() - began, 1)}
    if tenant is not None:
        entry["http_tenant"] = dict(tenant.statuses)
    return KindReport(result, entry)
