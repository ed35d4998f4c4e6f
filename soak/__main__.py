"""``python -m soak`` (``make soak``): the soak run, its table, and ``--json`` the report.
Exit status 0 only when the run passed (see ``soak.run``)."""

from __future__ import annotations

import argparse
import json
import sys

from soak.faults import FAULTS
from soak.run import SoakReport, SoakSettings, run_soak


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
    rows.append(f"| accounting | {report.requests} plans | crashes {report.crashes}, lost {report.lost}, duplicated "
                f"{report.duplicated}, late {report.late} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m soak", description=__doc__)
    p.add_argument("--frames", type=int, default=1_000_000, help="fuzz frames per daemon")
    p.add_argument("--http-requests", type=int, default=5_000)
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma list of {', '.join(FAULTS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the report here")
    args = p.parse_args(argv)
    faults = tuple(f for f in args.faults.split(",") if f)
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        p.error(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    report = run_soak(SoakSettings(frames=args.frames, http_requests=args.http_requests, faults=faults, seed=args.seed),
                      log=lambda line: print(line, flush=True))
    print(table(report))
    print("soak:", "PASSED" if report.passed else "FAILED")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.as_dict(), f, indent=2, default=str)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
