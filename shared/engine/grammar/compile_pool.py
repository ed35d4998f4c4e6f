"""Grammar compiles in worker processes, each with a time limit.

A compile can run for minutes (a nested schema ``pattern`` took 89 s) and xgrammar cannot be
interrupted inside a thread, so compiles run in ``workers`` subprocesses
(``python -m shared.engine.grammar.compile_worker``: the engine's process holds torch's
threads and is never forked, and multiprocessing's spawn would import the daemon's
``__main__`` again in each worker). A compile that spends more than ``timeout_s`` of CPU time
(its worker's, read from ``/proc``: the workers run at the lowest priority, so on a busy machine
a legitimate compile waits for the cores, and wall time would count that wait against it), or
``WALL_LIMIT_FACTOR`` times that in wall time, has its process killed and replaced, and raises
``CompileTimeout``; one that dies raises ValueError too. Each worker compiles one grammar at a
time, so a runaway holds one worker and the others go on compiling meanwhile.

The compiled grammar comes back as xgrammar's ``CompiledGrammar.serialize_json()`` and is
rebuilt here with ``deserialize_json`` against the same ``TokenizerInfo`` (xgrammar checks that
the tokenizer matches). A worker's start (importing xgrammar: seconds, about 300 MB) is not
counted against the limit: a compile waits for its worker to be ready, then the clock starts.
Workers start when a compile finds none free (an engine that compiles one grammar at a time
runs one), up to ``workers``; a killed one is replaced by the next compile that needs it.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import xgrammar as xgr

from shared.engine.grammar.response_format import GrammarSpec

log = logging.getLogger(__name__)
WORKER_START_S = 300.0  # a worker that is not ready by then is taken for dead
WALL_LIMIT_FACTOR = 10.0  # a compile is killed past this many times its CPU limit in wall time, CPU or not
_POLL_S = 0.5  # how often a compile's CPU time is read
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_ROOT = str(Path(__file__).resolve().parents[3])  # where the worker imports ``shared`` from
_WORKER_MAIN = (f"import sys; sys.path.insert(0, {_ROOT!r}); "
                "from shared.engine.grammar.compile_worker import serve; serve()")


class CompileTimeout(ValueError):
    """A grammar took longer than the pool's time limit to compile (its worker was killed)."""


@dataclass(eq=False)  # by identity: a set member
class _Worker:
    process: subprocess.Popen  # its stdin takes asks, its stdout gives replies (``compile_worker``)
    ready: bool = False  # it has its setup and said so (``compile_worker``'s first reply)

    def ask(self, message: dict) -> None:
        self.process.stdin.write(json.dumps(message).encode() + b"\n")
        self.process.stdin.flush()

    def cpu_seconds(self) -> float:
        """CPU time the worker has used, all its threads (0 once it has exited)."""
        try:
            with open(f"/proc/{self.process.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime, stime (fields 14, 15 of stat)

    def reply_within_cpu(self, cpu_limit_s: float, wall_limit_s: float) -> dict | None:
        """The next reply, or None once the worker has spent ``cpu_limit_s`` of CPU time on it
        or ``wall_limit_s`` have passed without one."""
        cpu_at, began = self.cpu_seconds(), time.monotonic()
        while (left := wall_limit_s - (time.monotonic() - began)) > 0:
            reply = self.reply(min(_POLL_S, left))
            if reply is not None:
                return reply
            if self.cpu_seconds() - cpu_at > cpu_limit_s:
                return None
        return None

    def reply(self, timeout_s: float) -> dict | None:
        """The next reply, or None when none began within ``timeout_s``."""
        readable, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        if not readable:
            return None
        line = self.process.stdout.readline()
        if not line:
            raise EOFError("the worker closed its output")
        return json.loads(line)

    def payload(self, size: int) -> str:
        """The ``size`` raw bytes that follow a ``compiled`` reply."""
        data = self.process.stdout.read(size)
        if len(data) != size:
            raise EOFError("the worker closed its output")
        return data.decode()


class CompilePool:
    """``workers`` compile processes for ``tokenizer_info``; ``compile`` is thread-safe and
    blocks its caller (call it from at most ``workers`` threads at once, as
    ``GrammarCompiler`` does, or callers queue for a free worker)."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, workers: int, timeout_s: float, compile_threads: int):
        if workers < 1 or not timeout_s > 0:
            raise ValueError(f"grammar compile workers >= 1 and timeout > 0, got {workers} and {timeout_s}")
        self.tokenizer_info = tokenizer_info
        self.timeout_s = timeout_s
        self._setup = {"tokenizer_info": tokenizer_info.serialize_json(), "threads": compile_threads}
        self._lock = threading.Lock()
        self._closed = False
        self._workers = workers
        self._all: set[_Worker] = set()
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        # NOTE: a pool dropped without close (an engine a test let go) still kills its workers
        self._finalizer = weakref.finalize(self, _kill_all, self._all, self._lock)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """``spec`` compiled by a free worker; ValueError naming the problem: xgrammar's
        rejection, ``CompileTimeout`` past ``timeout_s`` (the worker killed and replaced), a
        worker that died, or the pool closed."""
        worker = self._free_worker()
        if worker is None:
            raise ValueError(f"cannot compile {spec.kind.replace('_', ' ')}: the grammar compiler is closed")
        try:
            reply = self._ask(worker, spec)
        except BaseException:
            self._replace(worker)
            raise
        self._idle.put(worker)
        if "error" in reply:
            raise ValueError(reply["error"])
        return xgr.CompiledGrammar.deserialize_json(reply["compiled"], self.tokenizer_info)

    def close(self) -> None:
        """Kill every worker (a compile in progress raises ValueError)."""
        self._closed = True
        self._finalizer()

    def _ask(self, worker: _Worker, spec: GrammarSpec) -> dict:
        try:
            if not worker.ready:  # NOTE: sent here, not at start: the write blocks until it reads
                worker.ask(self._setup)
                if worker.reply(WORKER_START_S) is None:
                    raise ValueError(f"a grammar compile worker did not start in {WORKER_START_S:.0f} s")
                worker.ready = True
            worker.ask({"kind": spec.kind, "source": spec.source})
            reply = worker.reply_within_cpu(self.timeout_s, WALL_LIMIT_FACTOR * self.timeout_s)
            if reply is not None and "compiled" in reply:
                reply["compiled"] = worker.payload(reply["compiled"])
        except (EOFError, OSError, ValueError) as exc:
            why = "the grammar compiler is closed" if self._closed else f"the grammar compile worker failed ({exc})"
            raise ValueError(f"cannot compile {spec.kind.replace('_', ' ')}: {why}") from exc
        if reply is None:
            log.warning("a %s grammar compile ran past %s s: its worker is killed", spec.kind, self.timeout_s)
            raise CompileTimeout(f"the {spec.kind.replace('_', ' ')} took longer than {self.timeout_s:g} s of CPU "
                                 "time to compile (grammar_compile_timeout_s): simplify it")
        return reply

    def _free_worker(self) -> _Worker | None:
        """An idle worker, a new one while fewer than ``workers`` run, else the next freed (or
        started in place of a killed one); None once the pool is closed."""
        while not self._closed:
            try:
                return self._idle.get_nowait()
            except queue.Empty:
                pass
            with self._lock:
                if len(self._all) < self._workers and not self._closed:
                    worker = _Worker(subprocess.Popen([sys.executable, "-c", _WORKER_MAIN], stdin=subprocess.PIPE,
                                                      stdout=subprocess.PIPE))
                    self._all.add(worker)
                    return worker
            try:
                return self._idle.get(timeout=_POLL_S)
            except queue.Empty:
                continue
        return None

    def _replace(self, worker: _Worker) -> None:
        """Kill ``worker``; the next compile that finds no free worker starts one in its place."""
        with self._lock:
            self._all.discard(worker)
        _kill(worker)


def _kill_all(workers: set[_Worker], lock: threading.Lock) -> None:
    with lock:
        dying = list(workers)
        workers.clear()
    for worker in dying:
        _kill(worker)


def _kill(worker: _Worker) -> None:
    worker.process.kill()
    worker.process.wait(timeout=5)
    for pipe in (worker.process.stdin, worker.process.stdout):
        try:
            pipe.close()
        except OSError:  # a write the worker never read
            pass
