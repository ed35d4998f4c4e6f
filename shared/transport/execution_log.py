"""A daemon's journal of executions: one line when it starts running a request id, one when it
ends it. The lines outlive the process (a SIGKILL loses no line the kernel took), so a check
across restarts can count how often each request really ran: ``make soak`` reads the journals of
every cloudd and edged it started to prove that no request was executed twice.

A line is a JSON object, ``{"start": id}`` or ``{"end": id, "how": reason}``, written with one
``write`` to a file opened for appending (``0600``: request ids name the fleet's work). A
journal that cannot be written is reported once in the log and then skipped: bookkeeping never
stops a daemon from serving.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


class ExecutionLog:
    """Appends to ``path``; with no path every call does nothing."""

    def __init__(self, path: str | Path | None):
        self._fd: int | None = None
        self._failed = False
        if path:
            self._fd = os.open(Path(path).expanduser(), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def started(self, request_id: str) -> None:
        self._write({"start": request_id})

    def ended(self, request_id: str, how: str) -> None:
        self._write({"end": request_id, "how": how})

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _write(self, record: dict) -> None:
        if self._fd is None or self._failed:
            return
        try:
            os.write(self._fd, (json.dumps(record, ensure_ascii=True) + "\n").encode())
        except OSError as e:
            self._failed = True
            log.error("execution log not written from now on: %s", e)


@dataclass
class Executions:
    """How often one request id started and ended in one journal."""

    started: int = 0
    ended: int = 0


def read_executions(path: str | Path) -> dict[str, Executions]:
    """Every request id in the journal at ``path`` with its counts (a torn last line, as a kill
    mid-write leaves, is skipped)."""
    counts: dict[str, Executions] = {}
    with open(path, encoding="ascii", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if "start" in record:
                counts.setdefault(record["start"], Executions()).started += 1
            elif "end" in record:
                counts.setdefault(record["end"], Executions()).ended += 1
    return counts
