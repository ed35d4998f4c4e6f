"""A daemon's journal of executions: one line when it starts running a request id, one when it
ends it, with the result it ended with. The lines outlive the process (a SIGKILL loses no line
the kernel took), so

- a restart finds the results of the requests that ended before it (``read_kept_results``): a
  robot that resends a request whose answer the dead process never sent gets that answer, and
  the request does not run twice;
- a check across restarts can count how often each request really ran: ``make soak`` reads the
  journals of every cloudd and edged it started to prove that no request was executed twice.

A line is a JSON object, ``{"start": id}`` or ``{"end": id, "how": reason, "kept": {...}}``
(``kept``: a ``KeptResult``, for a request that ended with a result), written with one ``write``
to a file opened for appending (``0600``: request ids and results are the fleet's work). A
journal that cannot be written is reported once in the log and then skipped: bookkeeping never
stops a daemon from serving. The journal grows with every request; rotate it (it is read once,
at start-up, for the results younger than the ledger's TTL).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from shared.protocol.codec import ProtocolError, decode, encode
from shared.protocol.messages import Result

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeptResult:
    """A request that ended with a result, as a restart finds it: what a retry must match
    (``fingerprint``, the ledger's digest of the request), whose it is, its answer, and when it
    ended (``time.time()``)."""

    request_id: str
    fingerprint: bytes
    stream: bool
    robot_id: str
    result: Result
    finished_at: float

    def as_json(self) -> dict:
        return {"fp": self.fingerprint.hex(), "stream": self.stream, "robot": self.robot_id, "at": self.finished_at,
                "result": base64.b64encode(encode(self.result)).decode("ascii")}

    @classmethod
    def from_json(cls, request_id: str, value: dict) -> KeptResult:
        """ValueError (or KeyError, TypeError) for a record that is not one."""
        result = decode(base64.b64decode(value["result"]))
        if not isinstance(result, Result):
            raise ValueError("not a result")
        return cls(request_id, bytes.fromhex(value["fp"]), bool(value["stream"]), str(value["robot"]), result,
                   float(value["at"]))


class ExecutionLog:
    """Appends to ``path``; with no path every call does nothing."""

    def __init__(self, path: str | Path | None):
        self._fd: int | None = None
        self._failed = False
        if path:
            self._fd = os.open(Path(path).expanduser(), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def started(self, request_id: str) -> None:
        self._write({"start": request_id})

    def ended(self, request_id: str, how: str, kept: KeptResult | None = None) -> None:
        if self._fd is None or self._failed:  # NOTE: before kept.as_json(), which encodes the whole result
            return
        record = {"end": request_id, "how": how}
        if kept is not None:
            record["kept"] = kept.as_json()
        self._write(record)

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
    for record in _records(path):
        if "start" in record:
            counts.setdefault(record["start"], Executions()).started += 1
        elif "end" in record:
            counts.setdefault(record["end"], Executions()).ended += 1
    return counts


def read_kept_results(path: str | Path, max_age_s: float, now: float | None = None) -> list[KeptResult]:
    """The results in the journal at ``path`` that ended at most ``max_age_s`` ago, oldest first;
    an id's last line decides (one started again since is not kept). No file: none. A record
    that does not read is skipped (and said in the log): it costs a retry a second run, never
    the start-up."""
    now = time.time() if now is None else now
    latest: dict[str, dict | None] = {}  # the raw record: only the young survivors are decoded
    for record in _records(path) if Path(path).expanduser().exists() else ():
        if "start" in record:
            latest[record["start"]] = None
        elif "kept" in record:
            latest[record["end"]] = record["kept"]
    kept, unreadable = [], 0
    for request_id, value in latest.items():
        if value is None:
            continue
        try:
            if now - float(value["at"]) <= max_age_s:
                kept.append(KeptResult.from_json(request_id, value))
        except (ValueError, KeyError, TypeError, ProtocolError):
            unreadable += 1
    if unreadable:
        log.warning("%s: %d kept results unreadable, skipped", path, unreadable)
    return sorted(kept, key=lambda k: k.finished_at)


def _records(path: str | Path):
    with open(Path(path).expanduser(), encoding="ascii", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record
