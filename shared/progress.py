"""A one-line progress display for the bench commands (`cloudd bench`, `edged bench`), on stderr
so that stdout keeps the report (or the one ``--json`` object).

On a terminal the line is redrawn in place at most ``TTY_REFRESH_S`` apart; anywhere else (a
log file, a pipe, pytest's capture) a plain line is written at most every ``PLAIN_EVERY_S``, so
a long run still says it is alive without flooding the log.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from typing import TextIO

TTY_REFRESH_S = 0.25
PLAIN_EVERY_S = 15.0
BAR_WIDTH = 20

Counts = Callable[[], tuple[int, int]]  # () -> (requests done, output tokens so far)


class Progress:
    """Requests done / total, output tokens/s so far and elapsed seconds of one variant.

    ``update`` costs one clock read when no redraw is due, so a replay loop may call it every
    engine step; the counts are taken (``counts()``) only when a line is written. ``close``
    erases the terminal line, so the report printed next starts on a clean line. A disabled
    Progress writes nothing.
    """

    def __init__(self, label: str, total: int | None, *, enabled: bool = True, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.total, self.clock = label, total, clock
        self.stream = stream if stream is not None else sys.stderr
        self.tty = enabled and _isatty(self.stream)
        self.interval = TTY_REFRESH_S if self.tty else PLAIN_EVERY_S
        self.width = shutil.get_terminal_size((100, 24)).columns - 1 if self.tty else 0
        self.start = clock()
        # NOTE: disabled, the next redraw never comes due: update() is one comparison.
        self.next_draw = self.start + self.interval if enabled else float("inf")
        self.drawn = False

    def update(self, counts: Counts) -> None:
        """Write the line if one is due."""
        now = self.clock()
        if now < self.next_draw:
            return
        self.next_draw = now + self.interval
        self._write(self.line(*counts(), elapsed=now - self.start))

    def line(self, done: int, output_tokens: int, elapsed: float) -> str:
        """``label [#####.....] 12/16 req  340.2 out tok/s  3 s``; without a total, only the
        elapsed time (a peer run in another process)."""
        if self.total is None:
            return f"{self.label}: running, {elapsed:.0f} s"
        filled = BAR_WIDTH * done // max(self.total, 1)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        rate = output_tokens / elapsed if elapsed > 0 else 0.0
        return f"{self.label} [{bar}] {done}/{self.total} req  {rate:.1f} out tok/s  {elapsed:.0f} s"

    def close(self) -> None:
        """Erase the terminal line (a log keeps its plain lines)."""
        self.next_draw = float("inf")
        if self.tty and self.drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + text[: self.width])
            self.drawn = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or stand-in stream
        return False
