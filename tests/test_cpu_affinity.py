"""CPU lists and pinning (``shared.cpu_affinity``), and a daemon started on CPUs of its own."""

from __future__ import annotations

import os
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.cpu_affinity import available_cpus, format_cpu_list, parse_cpu_list, pinned
from shared.daemon_process import DaemonProcess


@given(st.frozensets(st.integers(0, 300), min_size=1))
def test_a_cpu_list_reads_back_as_the_set_it_was_written_from(cpus):
    text = format_cpu_list(cpus)
    assert parse_cpu_list(text) == cpus
    assert text.count(",") + 1 == sum(1 for c in cpus if c - 1 not in cpus)  # one item per run


def test_a_cpu_list_takes_the_kernels_form():
    assert parse_cpu_list("0-2, 5,7-7") == {0, 1, 2, 5, 7}


@pytest.mark.parametrize("text, error", [("", "expected numbers"), ("a", "expected numbers"), ("-1", "expected"),
                                         ("1-", "expected"), ("0,,1", "expected"), ("3-1", "runs backwards")])
def test_a_malformed_cpu_list_is_refused(text, error):
    with pytest.raises(ValueError, match=error):
        parse_cpu_list(text)


def one_cpu() -> frozenset[int]:
    mine = sorted(available_cpus())
    if len(mine) < 2:
        pytest.skip("pinning to a strict subset needs two CPUs")
    return frozenset(mine[-1:])


def test_pinned_moves_every_thread_and_gives_each_its_mask_back():
    cpu, mine = one_cpu(), available_cpus()
    go, seen = threading.Event(), {}

    def older():  # started before the block: moved too
        go.wait()
        seen["older"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=older)
    thread.start()
    with pinned(cpu):
        go.set()
        thread.join()
        newer = threading.Thread(target=lambda: seen.setdefault("newer", os.sched_getaffinity(0)))
        newer.start()
        newer.join()
        seen["main"] = os.sched_getaffinity(0)
    assert seen == {"older": cpu, "newer": cpu, "main": cpu}
    assert available_cpus() == mine


def test_pinned_refuses_cpus_this_process_may_not_use():
    mine = available_cpus()
    for cpus in (frozenset(), frozenset({max(mine) + 1})):
        with pytest.raises(ValueError, match="not among this process's"):
            with pinned(cpus):
                pass
    assert available_cpus() == mine


def test_a_daemon_runs_on_the_cpus_it_is_given():
    cpu = one_cpu()
    child = DaemonProcess("tests.affinity_child", [], ready="ready", timeout_s=60, cpus=cpu)
    try:
        assert child.fields["cpus"] == format_cpu_list(cpu)
    finally:
        child.kill()
    unpinned = DaemonProcess("tests.affinity_child", [], ready="ready", timeout_s=60)
    try:
        assert unpinned.fields["cpus"] == format_cpu_list(available_cpus())
    finally:
        unpinned.kill()


def test_a_thread_that_refuses_the_mask_leaves_no_other_thread_pinned(monkeypatch):
    cpu, mine = one_cpu(), available_cpus()
    go = threading.Event()
    other = threading.Thread(target=go.wait)
    other.start()
    real_set, calls = os.sched_setaffinity, []

    def refuse_the_second(tid, mask):
        calls.append(tid)
        if len(calls) == 2:
            raise OSError(22, "Invalid argument")
        real_set(tid, mask)

    monkeypatch.setattr(os, "sched_setaffinity", refuse_the_second)
    try:
        with pytest.raises(OSError):
            with pinned(cpu):
                pass
        masks = [os.sched_getaffinity(tid) for tid in (threading.get_native_id(), other.native_id)]
    finally:
        go.set()
        other.join()
    assert masks == [mine, mine]
