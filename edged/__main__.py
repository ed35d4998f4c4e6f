"""edged command line. The robot daemon (batch-1 serving, pinned prompts, escalation) arrives
with its own issue; until then this prints usage and exits non-zero."""

from __future__ import annotations

import sys

USAGE = """usage: edged {serve,export,bench} ...
edged is the on-robot daemon: batch-1 quantized decoding, pinned system prompts, escalation
to cloudd. It is not built yet; the shared engine it will drive is (see `cloudd bench`)."""


def main(argv: list[str] | None = None) -> int:
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
