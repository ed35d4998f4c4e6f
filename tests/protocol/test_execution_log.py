"""The execution journal: one start and one end line per execution, readable across restarts."""

from __future__ import annotations

import os
import stat

from shared.transport.execution_log import ExecutionLog, Executions, read_executions


def test_starts_and_ends_are_counted_per_request_id_across_incarnations(tmp_path):
    path = tmp_path / "executions.jsonl"
    first = ExecutionLog(path)
    first.started("amr-1/a"), first.started("amr-1/b"), first.ended("amr-1/a", "stop")
    first.close()  # a restart: the same file, appended to
    second = ExecutionLog(path)
    second.started("amr-1/b"), second.ended("amr-1/b", "length")
    second.close()
    assert read_executions(path) == {"amr-1/a": Executions(1, 1), "amr-1/b": Executions(2, 1)}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_odd_ids_survive_and_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "executions.jsonl"
    log = ExecutionLog(path)
    odd = 'a "quoted"\nid\u2603'
    log.started(odd), log.ended(odd, "abort")
    log.close()
    with open(path, "a") as f:
        f.write('{"start": "torn')  # a kill in the middle of a write
    assert read_executions(path) == {odd: Executions(1, 1)}


def test_without_a_path_nothing_is_written_and_a_failing_journal_never_raises(tmp_path):
    ExecutionLog(None).started("x")
    log = ExecutionLog(tmp_path / "j.jsonl")
    os.close(log._fd)  # the file descriptor goes bad under it
    log.started("x")
    log.ended("x", "stop")  # reported once, then skipped
