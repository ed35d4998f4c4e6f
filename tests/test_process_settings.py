"""The daemons' process-wide settings (``shared.config``): OpenMP waiting, the start-up heap."""

from __future__ import annotations

import gc
import os

from shared.config import SERVER_SPIN_COUNT, SHARED_CPU_SPIN_COUNT, freeze_start_up_heap, set_openmp_wait_defaults


def test_openmp_wait_defaults_do_not_override_the_environment(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    set_openmp_wait_defaults(SERVER_SPIN_COUNT)
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and os.environ["GOMP_SPINCOUNT"] == "7"


def test_openmp_wait_defaults_spin_as_the_daemon_asks(monkeypatch):
    for spin in (SERVER_SPIN_COUNT, SHARED_CPU_SPIN_COUNT):
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
        set_openmp_wait_defaults(spin)
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and os.environ["GOMP_SPINCOUNT"] == str(spin)


def test_the_start_up_heap_leaves_the_collectors_passes():
    built_at_start_up = [object() for _ in range(1000)]
    try:
        freeze_start_up_heap()
        assert gc.get_freeze_count() >= len(built_at_start_up)
    finally:
        gc.unfreeze()
