"""The Mailbox: events posted from other threads run on the loop's thread, and wake its poll."""

from __future__ import annotations

import os
import threading
import time

import zmq

from shared.transport.mailbox import Mailbox


def test_a_post_from_another_thread_wakes_the_poll_and_runs_on_the_loop_thread():
    box, ran_on = Mailbox(), []
    poller = zmq.Poller()
    poller.register(box.fd, zmq.POLLIN)
    assert poller.poll(0) == []
    threading.Thread(target=box.post, args=(lambda: ran_on.append(threading.current_thread()),)).start()
    assert poller.poll(5000) != []
    box.run()
    assert ran_on == [threading.main_thread()]
    assert poller.poll(0) == []  # read clean: the next poll sleeps again
    box.close()


def test_posting_never_blocks_however_many_wait():
    box, count = Mailbox(), []
    for _ in range(200_000):  # far past a pipe's buffer
        box.post(lambda: count.append(1))
    box.run()
    assert len(count) == 200_000
    box.close()


def test_run_waits_for_late_events_until_told_enough():
    box, seen = Mailbox(), []
    threading.Timer(0.05, box.post, args=(lambda: seen.append("late"),)).start()
    started = time.monotonic()
    box.run(wait_s=30, until=lambda: "late" in seen)
    assert seen == ["late"] and time.monotonic() - started < 30
    box.close()


def test_a_post_after_close_is_dropped_and_writes_to_no_reused_descriptor(tmp_path):
    """Found in review: a prepare still running at shutdown posted after the mailbox closed, and
    its wake-up byte went to whatever file had since been given the pipe's descriptor number."""
    box = Mailbox()
    box.close()
    files = [tmp_path / f"file{i}" for i in range(2)]
    fds = [os.open(f, os.O_WRONLY | os.O_CREAT) for f in files]  # the lowest free numbers: the pipe's two
    try:
        box.post(lambda: None)
        assert [f.read_bytes() for f in files] == [b"", b""]
    finally:
        for fd in fds:
            os.close(fd)
