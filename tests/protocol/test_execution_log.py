"""The execution journal: one start and one end line per execution, readable across restarts."""

from __future__ import annotations

import os
import stat

from shared.protocol.messages import Result, Usage
from shared.transport.execution_log import ExecutionLog, Executions, KeptResult, read_executions, read_kept_results


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


def kept(request_id: str, at: float, text: str = "done") -> KeptResult:
    return KeptResult(request_id, b"\x01" * 16, True, "amr-1", Result(request_id, text, "stop", Usage(3, 1)), at)


def test_a_result_kept_with_its_end_is_found_by_the_next_incarnation(tmp_path):
    path = tmp_path / "executions.jsonl"
    log = ExecutionLog(path)
    log.started("amr-1/a"), log.ended("amr-1/a", "stop", kept("amr-1/a", 1000.0))
    log.started("amr-1/b"), log.ended("amr-1/b", "internal")  # an error: nothing to keep
    log.started("amr-1/c")  # running when the process died: runs again on a retry
    log.close()
    assert read_kept_results(path, max_age_s=300, now=1100.0) == [kept("amr-1/a", 1000.0)]
    assert read_kept_results(path, max_age_s=300, now=1400.0) == []  # past the ledger's TTL
    assert read_executions(path) == {"amr-1/a": Executions(1, 1), "amr-1/b": Executions(1, 1),
                                     "amr-1/c": Executions(1, 0)}


def test_an_id_s_last_line_decides_and_an_unreadable_record_is_skipped(tmp_path):
    path = tmp_path / "executions.jsonl"
    log = ExecutionLog(path)
    log.ended("amr-1/a", "stop", kept("amr-1/a", 1000.0, "first"))
    log.started("amr-1/a")  # the id ran again (after the TTL): its old result is not its answer now
    log.ended("amr-1/b", "stop", kept("amr-1/b", 1001.0, "old"))
    log.ended("amr-1/b", "stop", kept("amr-1/b", 1002.0, "new"))
    log.close()
    with open(path, "a") as f:
        f.write('{"end": "amr-1/c", "how": "stop", "kept": {"fp": "zz", "result": "not base64"}}\n')
    assert read_kept_results(path, max_age_s=300, now=1100.0) == [kept("amr-1/b", 1002.0, "new")]
    assert read_kept_results(tmp_path / "missing.jsonl", max_age_s=300) == []


def test_without_a_journal_a_result_is_not_encoded(monkeypatch):
    monkeypatch.setattr(KeptResult, "as_json", lambda self: (_ for _ in ()).throw(AssertionError("encoded")))
    ExecutionLog(None).ended("amr-1/a", "stop", kept("amr-1/a", 1000.0))


def test_only_the_young_results_are_decoded_at_start_up(tmp_path, monkeypatch):
    path = tmp_path / "executions.jsonl"
    log = ExecutionLog(path)
    log.ended("amr-1/old", "stop", kept("amr-1/old", 500.0))
    log.ended("amr-1/gone", "stop", kept("amr-1/gone", 1000.0))
    log.started("amr-1/gone")
    log.ended("amr-1/new", "stop", kept("amr-1/new", 1000.0))
    log.close()
    decoded = []
    from_json = KeptResult.from_json.__func__
    monkeypatch.setattr(KeptResult, "from_json",
                        classmethod(lambda cls, rid, value: decoded.append(rid) or from_json(cls, rid, value)))
    assert read_kept_results(path, max_age_s=300, now=1100.0) == [kept("amr-1/new", 1000.0)]
    assert decoded == ["amr-1/new"]
