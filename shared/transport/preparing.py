"""Requests being prepared (tokenized, their grammar checked) on one thread beside a daemon's
loop, so that a long prompt or a new grammar never holds the loop: its health answers, its
steps run, its other messages are read meanwhile.

The loop thread owns every ``Admitting`` entry; the preparing thread runs only the work it is
given, and its outcome comes back to the loop through the daemon's ``Mailbox``. A retry of a
request still being prepared joins it; a cancel meanwhile is answered once it is prepared (the
request then never runs). One thread, not a pool: preparing is mostly tokenizing, which holds
the interpreter lock in parts, and more threads measured worse under load (docs/reliability.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from shared.protocol.messages import Generate, Message
from shared.transport.ledger import id_in_use
from shared.transport.mailbox import Mailbox

T = TypeVar("T")


@dataclass
class Admitting:
    """A request being prepared: who asked (a retry meanwhile joins), who cancelled it."""

    msg: Generate
    received: float  # time.monotonic() at arrival: its deadline counts from here
    identities: list[bytes]
    cancelled_by: list[bytes] = field(default_factory=list)

    @property
    def everyone(self) -> list[bytes]:
        """Whoever must hear how it ended: its senders, then those who cancelled it."""
        return self.identities + self.cancelled_by

    def deadline_left_s(self) -> float | None:
        """Seconds of its deadline left now (None: no deadline)."""
        if self.msg.deadline_ms is None:
            return None
        return self.msg.deadline_ms / 1000 - (time.monotonic() - self.received)


class Preparer(Generic[T]):
    """Loop thread's API (except the work itself, which runs on the preparing thread)."""

    def __init__(self, name: str, mailbox: Mailbox):
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._mailbox = mailbox
        self.pending: dict[str, Admitting] = {}

    def __len__(self) -> int:
        return len(self.pending)

    def rejoin(self, identity: bytes, msg: Generate) -> list[Message] | None:
        """None when ``msg``'s id is not being prepared; else the replies to send now: none when
        the same request joined (it hears the outcome), ``id_in_use`` for a different one."""
        pending = self.pending.get(msg.request_id)
        if pending is None:
            return None
        if pending.msg.fingerprint() != msg.fingerprint():
            return [id_in_use(msg.request_id)]
        if identity not in pending.identities:
            pending.identities.append(identity)
        return []

    def start(self, identity: bytes, msg: Generate, work: Callable[[], T],
              admit: Callable[[Admitting, Future[T]], None], here: bool = False) -> None:
        """Run ``work`` on the preparing thread, then ``admit(entry, its future)`` on the loop's
        thread (unless ``drain`` answered the request meanwhile). ``here``: the caller knows
        ``work`` is quick (a small request): run it and ``admit`` now, on the loop's thread, so
        that it does not queue behind a long one."""
        entry = Admitting(msg, time.monotonic(), [identity])
        if here:
            done: Future[T] = Future()
            try:
                done.set_result(work())
            except Exception as e:  # admit() reads it from the future, as from the thread's
                done.set_exception(e)
            admit(entry, done)
            return
        rid = msg.request_id
        self.pending[rid] = entry
        future = self._executor.submit(work)
        future.add_done_callback(lambda done: self._mailbox.post(lambda: self._prepared(rid, done, admit)))

    def _prepared(self, rid: str, done: Future[T], admit: Callable[[Admitting, Future[T]], None]) -> None:
        pending = self.pending.pop(rid, None)
        if pending is not None:
            admit(pending, done)

    def cancel(self, request_id: str, identity: bytes, robot: str | None = None) -> bool:
        """A cancel of a request being prepared (by ``robot``, or None: an operator): True when
        it is one, and ``identity`` will hear its outcome (it never runs)."""
        pending = self.pending.get(request_id)
        if pending is None or (robot is not None and pending.msg.robot_id != robot):
            return False
        pending.cancelled_by.append(identity)
        return True

    def drain(self) -> list[Admitting]:
        """Give up every request being prepared (shutting down): the caller answers them."""
        drained = list(self.pending.values())
        self.pending.clear()
        return drained

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
