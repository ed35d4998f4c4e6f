"""fleetctl, the operator's CLI. Its views (status, top, robots, requests) need cloudd's
metrics endpoint, which arrives with the fleet server; until then this prints usage."""

from __future__ import annotations

import sys

USAGE = """usage: fleetctl {status,top,robots,requests} [--json]
fleetctl watches a running cloudd. The fleet server is not built yet; `cloudd bench` measures
the engine in-process meanwhile."""


def main(argv: list[str] | None = None) -> int:
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
