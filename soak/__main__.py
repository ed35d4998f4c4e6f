"""``python -m soak`` (``make soak``): the soak run, its table, and ``--json`` the report.
Exit status 0 only when the run passed (see ``soak.run``). ``--only hostile`` runs one phase
(``--only fuzz,faults`` two), ``--hostile-kinds`` some of the hostile phase's attack kinds."""

from __future__ import annotations

import argparse
import json
import sys

from soak.attacks import ATTACKS
from soak.faults import FAULTS
from soak.hostile import HostileSettings
from soak.run import PHASES, SoakReport, SoakSettings, run_soak


def table(report: SoakReport) -> str:
    rows = ["| part | what was done | result |", "|---|---|---|"]
    for name in ("cloudd", "edged"):
        if name in report.fuzz:
            d = report.fuzz[name]
            rows.append(f"| fuzz {name} | {d['frames']:,} frames ({d['frames_per_s']:,}/s) | {d['answered']:,} "
                        f"answered, {d['dropped']:,} dropped; health max {d['health']['max_ms']} ms, "
                        f"p99 {d['health']['p99_ms']} ms, {d['health']['over_bound']} over "
                        f"{d['health']['bound_ms']:.0f} ms; RSS {d['resources']['rss_growth_mb']:+} MB, threads "
                        f"{d['resources']['thread_growth']:+}, fds {d['resources']['fd_growth']:+} |")
    if "http" in report.fuzz:
        h = report.fuzz["http"]
        rows.append(f"| fuzz HTTP | {h['requests']:,} malformed, {h['slow_sent']} half-sent, {h['idle_connections']} "
                    f"idle | statuses {h['statuses']}; 500s {h['server_errors']}; half-sent let go "
                    f"{h['slow_closed_by_server']}/{h['slow_sent']}; answers after: {h['answered_after_idle']} |")
    for name, f in report.faults.items():
        rows.append(f"| fault {name} | {f['requests']} plans in flight | {f['answers']}; lost {f['lost']}, late "
                    f"{f['late']}; kv {f['kv_check']}; prefix exact {f['prefix_exact']} |")
    for kind, h in report.hostile.items():
        rows.append(f"| hostile {kind} | attacker sent {h['attack']['sent']:,} | {'PASS' if h['passed'] else 'FAIL'}: "
                    f"victim gap p99 {h['victim_gap_p99_s']} s, baseline {h['baseline_gap_p99_s']} s "
                    f"(x{h['ratio']}); lost {h['lost']}, refused {h['refused']}, crashes {h['crashes']} |")
    rows.append(f"| accounting | {report.requests} plans | crashes {report.crashes}, lost {report.lost}, duplicated "
                f"{report.duplicated}, late {report.late} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m soak", description=__doc__)
    p.add_argument("--frames", type=int, default=1_000_000, help="fuzz frames per daemon")
    p.add_argument("--http-requests", type=int, default=5_000)
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma list of {', '.join(FAULTS)}")
    p.add_argument("--only", default=",".join(PHASES), help=f"comma list of phases: {', '.join(PHASES)}")
    p.add_argument("--hostile-kinds", default=",".join(ATTACKS), help=f"comma list of {', '.join(ATTACKS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the report here")
    args = p.parse_args(argv)
    faults, phases, kinds = (_names(p, value, known, what) for value, known, what in (
        (args.faults, FAULTS, "faults"), (args.only, PHASES, "phases"), (args.hostile_kinds, ATTACKS, "attack kinds")))
    settings = SoakSettings(frames=args.frames, http_requests=args.http_requests, faults=faults, seed=args.seed,
                            phases=phases, hostile=HostileSettings(kinds=kinds))
    report = run_soak(settings, log=lambda line: print(line, flush=True))
    print(table(report))
    print("soak:", "PASSED" if report.passed else "FAILED")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.as_dict(), f, indent=2, default=str)
    return 0 if report.passed else 1


def _names(parser: argparse.ArgumentParser, value: str, known, what: str) -> tuple[str, ...]:
    """The comma list ``value`` as a tuple; exits with a usage error naming any unknown name."""
    names = tuple(name for name in value.split(",") if name)
    unknown = [name for name in names if name not in known]
    if unknown:
        parser.error(f"unknown {what} {unknown}; known: {', '.join(known)}")
    return names


if __name__ == "__main__":
    sys.exit(main())
