"""DaemonProcess: its child's stderr is readable while it runs and leaves no file behind."""

from __future__ import annotations

import tempfile
from pathlib import Path

from shared.daemon_process import DaemonProcess


def _named_logs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("tests.affinity_child-*"))


def test_the_childs_stderr_is_read_without_a_file_on_disk():
    before = _named_logs()
    child = DaemonProcess("tests.affinity_child", [], ready="ready", timeout_s=60)
    try:
        assert f"started on cpus {child.fields['cpus']}" in child.log()
        assert child.log(tail_bytes=8) == child.log()[-8:]
        assert _named_logs() == before
    finally:
        code = child.terminate()
    assert code == -15  # SIGTERM: the child has no handler of its own
    assert "started on cpus" in child.log()  # still readable after the child ended
