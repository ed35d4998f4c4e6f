"""Run a fleetserve daemon as a real child process on loopback (integration tests, the demo)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


class DaemonProcess:
    """``python -m <module> <args>``; waits for its ready line on stdout.

    ``fields`` holds the ``key=value`` pairs of the ready line (e.g. ``zmq``, ``http``). stderr
    goes to an unnamed temporary file (nothing is left on disk), whose end ``log()`` shows when a
    test needs to explain a failure.
    ``cpus``: the CPUs the child runs on (all of this process's when None).
    """

    def __init__(self, module: str, args: list[str], ready: str, timeout_s: float = 180.0,
                 cpus: frozenset[int] | None = None):
        self.module = module
        self._stderr = tempfile.TemporaryFile(prefix=f"{module}-", suffix=".log")
        env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, "PYTHONUNBUFFERED": "1"}  # PASSIVE unless the user says
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env,
            cwd=Path(__file__).resolve().parents[1],  # the repository root
        )
        if cpus is not None:
            # NOTE: Popen returns once the child has exec'd Python, which starts single-threaded: its
            # first thread comes with its imports, long after this call, and inherits the mask
            try:
                os.sched_setaffinity(self.proc.pid, cpus)
            except OSError:
                self.kill()
                raise
        self.lines: list[str] = []
        found = threading.Event()
        self.fields: dict[str, str] = {}

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                if line.startswith(ready) and not found.is_set():
                    self.fields = dict(re.findall(r"(\w+)=(\S+)", line))
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(timeout_s) or not self.fields:
            self.kill()
            raise RuntimeError(f"{module} did not become ready:\n{self.log()}")

    def log(self, tail_bytes: int = 4000) -> str:
        """The last ``tail_bytes`` of the child's stderr so far."""
        # NOTE: pread leaves the offset the child shares with this file object where its writes go
        fd = self._stderr.fileno()
        size = os.fstat(fd).st_size
        start = max(0, size - tail_bytes)
        return os.pread(fd, size - start, start).decode(errors="replace")

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (a graceful shutdown) and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
