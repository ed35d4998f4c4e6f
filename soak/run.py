"""One soak run: start the fleet, fuzz both daemons and cloudd's HTTP API, run the fault matrix
with plans in flight, run the hostile-tenant phase (``soak.hostile``), account for every request,
and return the report (``SoakReport``). ``SoakSettings.phases`` picks the phases ("fuzz",
"faults", "hostile"); edged is started only for the first two.

Accounting, over every plan the robots sent:

- ``lost``: no answer (a plan or a typed error) by its deadline plus 30 s (240 s without one),
  or an exception robot_sdk does not define;
- ``late``: an answer past its deadline plus ``LATE_MARGIN_S``;
- ``duplicated``: a request id that ran to its end more than once in one daemon's execution
  journal (across that daemon's restarts). A run cut short by a kill, then resent and run
  again, is one execution: its first run never ended;
- ``crashes``: a daemon that exited without the harness killing it.

The hostile phase adds its victim's plans to ``requests`` and ``lost``, and its per-kind verdicts
(``hostile.<kind>``, each with ``victim_gap_p99_s`` and ``baseline_gap_p99_s``) to the pass.

After each fault, once cloudd is idle, ``kv_check`` must say "ok" (every KV block free or held by
the prefix cache alone) and a greedy probe answered from the prefix cache must give the tokens it
gave before any fault (``prefix_exact``).
"""

from __future__ import annotations

import platform
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from shared.transport.client import FleetClient
from shared.transport.execution_log import read_executions
from soak.faults import FAULTS, restore_disk_dir, run_fault
from soak.fleet import FUZZ_ROBOT, Fleet
from soak.fuzz_frames import FrameSource
from soak.hostile import HostileSettings, run_hostile
from soak.hostile_bar import verdict_lines
from soak.http_fuzz import fuzz_http
from soak.plans import LATE_MARGIN_S, Outcome, Traffic
from soak.probes import HealthWatch, ProcessResources, resources_dict
from soak.socket_fuzz import fuzz_socket

DIRECT_ROBOTS = ["amr-001", "amr-002", "amr-003", "amr-004"]
PROBE = [{"role": "user", "content": "List three things a warehouse robot checks before it lifts a shelf."}]
RSS_BOUND_MB = 256.0  # a daemon's growth over a million fuzz frames (allocator and caches warming)
PHASES = ("fuzz", "faults", "hostile")


@dataclass(frozen=True)
class SoakSettings:
    frames: int = 1_000_000  # per daemon
    http_requests: int = 5_000
    faults: tuple[str, ...] = tuple(FAULTS)
    seed: int = 0
    # per daemon; cloudd took 175 to 380 s for its million on machines of this kind (its engine
    # computing the fuzz's valid requests, some of thousands of tokens, takes the cores)
    fuzz_time_limit_s: float = 420.0
    phases: tuple[str, ...] = PHASES
    hostile: HostileSettings = HostileSettings()


@dataclass
class SoakReport:
    fuzz: dict = field(default_factory=dict)
    faults: dict = field(default_factory=dict)
    hostile: dict = field(default_factory=dict)  # per attack kind: soak.hostile's entry
    requests: int = 0
    answers: Counter = field(default_factory=Counter)
    crashes: int = 0
    lost: int = 0
    duplicated: int = 0
    late: int = 0
    details: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        fuzz_ok = all(d.get("undecodable_replies", 0) == 0 and d["health"]["over_bound"] == 0
                      and d["resources"]["rss_growth_mb"] <= RSS_BOUND_MB and d["resources"]["thread_growth"] <= 2
                      and d["resources"]["fd_growth"] <= 2 for name, d in self.fuzz.items() if name != "http")
        faults_ok = all(f["kv_check"] == "ok" and f["prefix_exact"] for f in self.faults.values())
        http = self.fuzz.get("http")
        http_ok = not http or (http["server_errors"] == 0 and http["answered_after_idle"]
                               and http["slow_closed_by_server"] == http["slow_sent"] and http["health"]["over_bound"] == 0)
        hostile_ok = all(entry["passed"] for entry in self.hostile.values())
        return fuzz_ok and faults_ok and http_ok and hostile_ok and not (self.crashes or self.lost or self.duplicated
                                                                         or self.late)

    def as_dict(self) -> dict:
        return {"passed": self.passed, "fuzz": self.fuzz, "faults": self.faults, "hostile": self.hostile,
                "requests": self.requests,
                "answers": dict(self.answers), "crashes": self.crashes, "lost": self.lost,
                "duplicated": self.duplicated, "late": self.late, "late_margin_s": LATE_MARGIN_S,
                "rss_bound_mb": RSS_BOUND_MB, **self.details}


def run_soak(settings: SoakSettings, log=print) -> SoakReport:
    report = SoakReport()
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fleetserve-soak-") as tmp:
        fleet = Fleet(Path(tmp), DIRECT_ROBOTS)
        try:
            log("starting the fleet (CURVE on, loopback only)...")
            fleet.start_cloudd()
            if "fuzz" in settings.phases or "faults" in settings.phases:
                fleet.start_edged()
            probe = _probe(fleet)  # before any fuzz or fault: what every fault's check compares with
            log(f"prefix probe: {probe!r}")
            if "fuzz" in settings.phases:
                _fuzz(fleet, settings, report, log)
            if "faults" in settings.phases:
                _faults(fleet, settings, report, probe, log)
            if "hostile" in settings.phases:
                _hostile(fleet, settings, report, log)
            fleet.check_alive()
        finally:
            codes = fleet.stop()
        report.crashes = len(fleet.exits)
        report.duplicated, interrupted = _duplicates(fleet)
        report.details = {"exit_codes": codes, "crash_logs": fleet.exits, "interrupted_executions": interrupted,
                          "torn_pages": fleet.torn_pages,
                          "disk_write_errors": fleet.disk_write_errors, "seconds": round(time.monotonic() - began, 1),
                          "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()}}
    return report


def _faults(fleet: Fleet, settings: SoakSettings, report: SoakReport, probe: dict, log) -> None:
    traffic = Traffic(lambda robot: fleet.robot_client(robot))
    for name in settings.faults:
        log(f"fault {name}: plans in flight...")
        started = time.monotonic()
        try:
            outcomes = run_fault(FAULTS[name], fleet, traffic)
        finally:
            restore_disk_dir(fleet)
        fleet.check_alive()
        report.faults[name] = _fault_entry(fleet, outcomes, probe, time.monotonic() - started)
        _account(report, outcomes)
        log(f"fault {name}: {report.faults[name]}")


def _hostile(fleet: Fleet, settings: SoakSettings, report: SoakReport, log) -> None:
    log(f"hostile tenants: {', '.join(settings.hostile.kinds)}...")
    kinds = run_hostile(fleet, settings.hostile, lambda: _idle_stats(fleet, wait_s=30.0), log)
    for kind in kinds:
        report.hostile[kind.result.kind] = kind.entry
        report.requests += kind.entry["victim_plans"] + kind.entry["baseline_plans"]
        report.lost += kind.result.lost
    for line in verdict_lines([kind.result for kind in kinds]):
        log(line)


def _fuzz(fleet: Fleet, settings: SoakSettings, report: SoakReport, log) -> None:
    targets = (("cloudd", fleet.cloudd_endpoint, fleet.curve_for(FUZZ_ROBOT), fleet.cloudd),
               ("edged", fleet.edged_endpoint, None, fleet.edged))
    for name, endpoint, curve, daemon in targets:
        log(f"fuzzing {name} with {settings.frames:,} frames...")
        before = ProcessResources.of(daemon.proc.pid)
        with HealthWatch(endpoint, fleet.operator_curve() if curve is not None else None) as watch:
            counts = fuzz_socket(endpoint, FrameSource(settings.seed, FUZZ_ROBOT, FUZZ_ROBOT), settings.frames,
                                 curve=curve, time_limit_s=settings.fuzz_time_limit_s)
        time.sleep(2.0)  # replies to the last frames, and the daemon's own settling
        after = ProcessResources.of(daemon.proc.pid)
        report.fuzz[name] = {**counts.as_dict(), "health": watch.summary(), "resources": resources_dict(before, after)}
        log(f"{name}: {report.fuzz[name]}")
        fleet.check_alive()
    if settings.http_requests:
        log(f"fuzzing cloudd's HTTP API with {settings.http_requests:,} requests...")
        with HealthWatch(fleet.cloudd_endpoint, fleet.operator_curve()) as watch:
            http = fuzz_http(fleet.http_port, fleet.api_key, settings.http_requests, settings.seed,
                             fleet.tuning.http_timeout_s)
        report.fuzz["http"] = {**http.as_dict(), "health": watch.summary()}
        log(f"http: {report.fuzz['http']}")
        fleet.check_alive()


def _probe(fleet: Fleet) -> dict:
    """A greedy chat at cloudd once it is idle; compared after every fault."""
    client = fleet.robot_client(DIRECT_ROBOTS[0])
    try:
        reply = client.chat(PROBE, max_tokens=24, temperature=0.0)
    finally:
        client.close()
    return {"text": reply.text, "cached_tokens": reply.usage.get("cached_tokens", 0)}


def _fault_entry(fleet: Fleet, outcomes: list[Outcome], probe: dict, seconds: float) -> dict:
    kv_check, stats = _idle_stats(fleet)
    tiers = stats.get("tiers") or {}
    again = _probe(fleet)
    edge_stats = _edge_stats(fleet)
    return {
        "requests": len(outcomes), "answers": dict(Counter(o.kind for o in outcomes)),
        "sources": dict(Counter(o.answer for o in outcomes if o.answer and o.answer.startswith("plan"))),
        "lost": sum(o.lost for o in outcomes), "late": sum(o.late for o in outcomes),
        "kv_check": kv_check, "prefix_exact": again["text"] == probe["text"],
        "probe_cached_tokens": again["cached_tokens"],
        "edged_pinned_from_disk": [p["from_disk"] for p in edge_stats.get("pinned", [])],
        "cloudd_tiers": {k: tiers.get(k) for k in ("load_failures", "copy_errors", "disk_pages")},
        "seconds": round(seconds, 1),
    }


def _idle_stats(fleet: Fleet, wait_s: float = 120.0) -> tuple[str, dict]:
    """cloudd's ``kv_check`` once it is idle (or "busy" after ``wait_s``), and its stats then."""
    ends = time.monotonic() + wait_s
    with fleet.operator() as operator:
        while True:
            stats = operator.stats(timeout_s=10)
            check = stats.get("kv_check", "missing")
            if check != "busy" or time.monotonic() > ends:
                return check, stats
            time.sleep(0.5)


def _edge_stats(fleet: Fleet) -> dict:
    with FleetClient(fleet.edged_endpoint) as client:
        return client.stats(timeout_s=10)


def _account(report: SoakReport, outcomes: list[Outcome]) -> None:
    report.requests += len(outcomes)
    report.lost += sum(o.lost for o in outcomes)
    report.late += sum(o.late for o in outcomes)
    report.answers.update(o.kind for o in outcomes)


def _duplicates(fleet: Fleet) -> tuple[int, int]:
    """(request ids run to their end more than once, runs cut short) over both daemons' journals."""
    duplicated = interrupted = 0
    for journal in (fleet.cloudd_journal, fleet.edged_journal):
        if journal.exists():
            for counts in read_executions(journal).values():
                duplicated += max(0, counts.ended - 1)
                interrupted += max(0, counts.started - counts.ended)
    return duplicated, interrupted
